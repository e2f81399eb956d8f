//! How the main listener's connections are spread over the serving threads (`sluice run
//! --threads N`): one thread accepts, and each new connection goes to the thread with the
//! fewest open connections (HAProxy hands connections to threads the same way; Envoy calls it
//! "exact balance"). Each thread then serves its connections on its own runtime, so a request
//! still never crosses threads.
//!
//! Why not one `SO_REUSEPORT` socket per thread, as before: the kernel places a connection by
//! a hash of its addresses, which evens out only over many connections. In front of sluice
//! there is usually a load balancer or an ingress keeping a few long-lived connections, and
//! a hash puts two of four on the same thread about as often as not, while another thread
//! idles: that thread's share of the traffic, not the machine, is then the gateway's limit.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::server::Permit;

/// A connection accepted by one thread for another to serve.
#[derive(Debug)]
pub(crate) struct Handoff {
    pub(crate) stream: std::net::TcpStream,
    pub(crate) peer: SocketAddr,
    pub(crate) permit: Option<Permit>,
    pub(crate) open: Open,
}

/// The serving threads' open connections, and the way to hand a connection to each. Thread 0
/// is the one that accepts; it serves connections too.
#[derive(Debug)]
pub(crate) struct Spread {
    open: Box<[AtomicUsize]>,
    /// Where the next search starts, so that ties go round the threads.
    next: AtomicUsize,
    /// Threads 1.. (index 0 is thread 1).
    workers: Vec<mpsc::UnboundedSender<Handoff>>,
}

/// Where a new connection goes.
#[derive(Debug)]
pub(crate) enum Place {
    /// Serve it on this thread (thread 0).
    Here(Open),
    /// Hand it to another thread.
    There(usize, Open),
}

impl Spread {
    /// A spread over this thread and one more per sender.
    pub(crate) fn new(workers: Vec<mpsc::UnboundedSender<Handoff>>) -> Arc<Self> {
        Arc::new(Spread {
            open: (0..=workers.len()).map(|_| AtomicUsize::new(0)).collect(),
            next: AtomicUsize::new(0),
            workers,
        })
    }

    /// The thread with the fewest open connections (counted from now: the connection is
    /// counted until the returned [`Open`] drops).
    pub(crate) fn pick(self: &Arc<Self>) -> Place {
        let n = self.open.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let thread = (start..start + n)
            .map(|i| i % n)
            .min_by_key(|&i| self.open[i].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.open[thread].fetch_add(1, Ordering::Relaxed);
        let open = Open {
            spread: Arc::clone(self),
            thread,
        };
        match thread {
            0 => Place::Here(open),
            t => Place::There(t, open),
        }
    }

    /// Hands `handoff` to thread `thread`; gives it back if that thread has stopped.
    pub(crate) fn hand(&self, thread: usize, handoff: Handoff) -> Result<(), Handoff> {
        match self.workers.get(thread - 1) {
            Some(tx) => tx.send(handoff).map_err(|e| e.0),
            None => Err(handoff),
        }
    }

    /// Open connections per thread, for tests.
    #[cfg(test)]
    fn counts(&self) -> Vec<usize> {
        self.open
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// One open connection, counted on its thread until dropped.
#[derive(Debug)]
pub(crate) struct Open {
    spread: Arc<Spread>,
    thread: usize,
}

impl Open {
    /// Counts it on this thread instead (its thread could not take it).
    pub(crate) fn move_here(mut self) -> Open {
        self.spread.open[self.thread].fetch_sub(1, Ordering::Relaxed);
        self.spread.open[0].fetch_add(1, Ordering::Relaxed);
        self.thread = 0;
        self
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.spread.open[self.thread].fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spread(threads: usize) -> (Arc<Spread>, Vec<mpsc::UnboundedReceiver<Handoff>>) {
        let (txs, rxs) = (1..threads).map(|_| mpsc::unbounded_channel()).unzip();
        (Spread::new(txs), rxs)
    }

    fn thread_of(p: &Place) -> usize {
        match p {
            Place::Here(_) => 0,
            Place::There(t, _) => *t,
        }
    }

    #[test]
    fn each_connection_goes_to_a_thread_with_the_fewest_open() {
        let (s, _rx) = spread(3);
        let first: Vec<Place> = (0..6).map(|_| s.pick()).collect();
        assert_eq!(s.counts(), [2, 2, 2], "six over three threads");
        let mut on = first.iter().map(thread_of).collect::<Vec<_>>();
        on.sort_unstable();
        assert_eq!(on, [0, 0, 1, 1, 2, 2]);
        // Two connections of thread 1 end: the next two go there.
        let mut first = first;
        let ended: Vec<usize> = (0..first.len())
            .filter(|&i| thread_of(&first[i]) == 1)
            .collect();
        for i in ended.into_iter().rev() {
            drop(first.remove(i));
        }
        assert_eq!(s.counts(), [2, 0, 2]);
        let next = [s.pick(), s.pick()];
        assert_eq!(next.iter().map(thread_of).collect::<Vec<_>>(), [1, 1]);
        assert_eq!(s.counts(), [2, 2, 2]);
        drop(next);
        drop(first);
        assert_eq!(s.counts(), [0, 0, 0]);
    }

    #[test]
    fn a_connection_a_stopped_thread_cannot_take_comes_back_and_is_counted_here() {
        let (s, rx) = spread(2);
        drop(rx); // thread 1 has stopped
        let picks = [s.pick(), s.pick()];
        assert_eq!(s.counts(), [1, 1]);
        let ([Place::There(t, open), _] | [_, Place::There(t, open)]) = picks else {
            panic!("one of two goes to thread 1")
        };
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let handoff = Handoff {
            peer: stream.local_addr().unwrap(),
            stream,
            permit: None,
            open,
        };
        let back = s.hand(t, handoff).expect_err("thread 1 has stopped");
        let open = back.open.move_here();
        assert_eq!(s.counts(), [2, 0]);
        drop(open);
        assert_eq!(s.counts(), [1, 0]);
    }
}
