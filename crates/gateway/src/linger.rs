//! A lingering close, as nginx's `lingering_close`: a connection that ends with the client's
//! bytes still arriving (HTTP/2 `WINDOW_UPDATE`s and `PING` answers as it reads a download,
//! the rest of a request hyper did not read before its answer) is not closed outright. Linux
//! answers `close` on a socket with unread bytes with a reset, which throws away what the
//! socket still had to send: the client lost the tail of its response (review: HTTP/2
//! downloads at shutdown ended in "connection reset" megabytes short). Instead the gateway
//! shuts its side down (a FIN after the last byte) and reads and discards until the client
//! closes too, for at most [`LINGER_IDLE`] between reads and the header timeout in all (the
//! time an idle connection may hold its place anyway: a client cannot make one request hold a
//! place longer than that by trickling bytes after it).
//!
//! Before that, the socket sends what it still holds. A client reading the end of a large
//! response slowly can send nothing for longer than [`LINGER_IDLE`] (an HTTP/2 client with a
//! large window sends its next `WINDOW_UPDATE` only after reading much of it), and its next
//! byte after the close was answered with a reset that threw away the rest (review: 2 of 15
//! downloads at 200-300 KB/s lost about 330 KB at shutdown). So the side is shut down only
//! once the kernel has sent everything (`TCP_NOTSENT_LOWAT` of one byte makes `POLLOUT` say
//! so), within the send timeout: the time a response waiting on its client has anyway.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// The longest a lingering connection waits for the client's next bytes (at most its `max`).
pub(crate) const LINGER_IDLE: Duration = Duration::from_secs(5);

/// A connection's socket, given back through `back` when the connection drops it, so that
/// the connection's task can close it with [`linger`]. (A tunnel that takes the connection
/// drops it later, when nobody waits for it any more: it is then closed as usual.)
#[derive(Debug)]
pub(crate) struct GiveBack {
    stream: Option<TcpStream>,
    back: Option<oneshot::Sender<TcpStream>>,
}

impl GiveBack {
    pub(crate) fn new(stream: TcpStream) -> (Self, oneshot::Receiver<TcpStream>) {
        let (back, given) = oneshot::channel();
        let io = GiveBack {
            stream: Some(stream),
            back: Some(back),
        };
        (io, given)
    }

    /// Polls the socket with `f`, or fails if it was given back (never while hyper has it).
    fn poll<R>(
        self: Pin<&mut Self>,
        f: impl FnOnce(Pin<&mut TcpStream>) -> Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        match &mut self.get_mut().stream {
            Some(stream) => f(Pin::new(stream)),
            None => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        if let (Some(stream), Some(back)) = (self.stream.take(), self.back.take()) {
            let _ = back.send(stream);
        }
    }
}

impl AsyncRead for GiveBack {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.poll(|s| s.poll_read(cx, buf))
    }
}

impl AsyncWrite for GiveBack {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll(|s| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll(|s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll(|s| s.poll_flush(cx))
    }

    /// Not done while the connection's task waits to take the socket back: its lingering
    /// close shuts the socket down once it has sent all it holds, and a FIN queued now would
    /// make that wait see nothing left to wait for (review: hyper and h2 shut the socket down
    /// as they end, so the wait never happened). A tunnel's shutdowns, later, go through.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.back.as_ref().is_some_and(|back| !back.is_closed()) {
            return Poll::Ready(Ok(()));
        }
        self.poll(|s| s.poll_shutdown(cx))
    }
}

/// Closes `stream` without a reset: waits (at most `flush`) until the socket has sent all it
/// holds, reading and discarding meanwhile; shuts the gateway's side down; then reads and
/// discards until the client closes, an error, [`LINGER_IDLE`] without a byte, or `max`. All
/// of it ends at `cut` (the shutdown grace's end).
pub(crate) async fn linger(
    mut stream: TcpStream,
    max: Duration,
    flush: Duration,
    cut: impl Future<Output = ()>,
) {
    let mut buf = vec![0u8; 4096];
    let reads = async {
        let until = tokio::time::Instant::now() + flush;
        if !sent_all(&stream, &mut buf, until).await {
            return;
        }
        if stream.shutdown().await.is_err() {
            return;
        }
        let deadline = tokio::time::Instant::now() + max;
        loop {
            let idle_until = deadline.min(tokio::time::Instant::now() + LINGER_IDLE);
            match tokio::time::timeout_at(idle_until, stream.read(&mut buf)).await {
                Ok(Ok(1..)) => {}
                // Closed, failed, or quiet for too long.
                Ok(Ok(0) | Err(_)) | Err(_) => return,
            }
        }
    };
    tokio::select! {
        () = reads => {}
        () = cut => {}
    }
}

/// How often a socket still sending is looked at, should its wake-up not come.
const SENT_CHECK: Duration = Duration::from_secs(1);

/// Waits until `stream` has sent everything it holds, reading and discarding what the client
/// sends meanwhile. `false` if the client closed or failed first (a close now resets nothing:
/// no byte of the client's is left unread), or `until` passed. Also `true` where the kernel
/// cannot tell (no `TCP_NOTSENT_LOWAT`): the lingering close then goes on as before.
async fn sent_all(stream: &TcpStream, buf: &mut [u8], until: tokio::time::Instant) -> bool {
    // Writable from now on only when nothing is left unsent; nothing else writes to it.
    if socket2::SockRef::from(stream)
        .set_tcp_notsent_lowat(1)
        .is_err()
    {
        return true;
    }
    loop {
        // Forget the readiness hyper's writes left, then look: a wake-up after this one
        // look is not missed, as the socket stays registered.
        let _ = stream.try_io(tokio::io::Interest::WRITABLE, || {
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        });
        if nothing_unsent(stream) {
            return true;
        }
        let check = tokio::time::Instant::now() + SENT_CHECK;
        tokio::select! {
            ready = stream.readable() => match ready.and_then(|()| stream.try_read(buf)) {
                Ok(1..) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Ok(0) | Err(_) => return false,
            },
            _ = stream.writable() => {}
            () = tokio::time::sleep_until(check.min(until)) => {
                if tokio::time::Instant::now() >= until {
                    return false;
                }
            }
        }
    }
}

/// Whether the socket reports itself writable: with `TCP_NOTSENT_LOWAT` at one byte, that is
/// when every byte written has been sent (Linux's `tcp_poll`). An error counts as nothing left
/// to wait for.
fn nothing_unsent(stream: &TcpStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(stream, PollFlags::OUT)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&now)) {
        Ok(_) => !fds[0].revents().is_empty(),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// Accepts one connection and ends it as a connection ends in the gateway: hyper writes
    /// `size` bytes, shuts down and drops its IO; then, with `flush`, the lingering close (the
    /// header timeout 10 s), else the socket's close outright.
    fn respond_and_end(
        listener: TcpListener,
        size: usize,
        flush: Option<Duration>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let (mut io, given) = GiveBack::new(stream);
            io.write_all(&vec![7u8; size]).await.unwrap();
            io.shutdown().await.unwrap();
            drop(io);
            let stream = given.await.expect("given back on drop");
            if let Some(flush) = flush {
                let max = Duration::from_secs(10);
                linger(stream, max, flush, std::future::pending()).await;
            }
        })
    }

    /// A server that writes `size` bytes, then closes while the client's bytes still arrive;
    /// the client reads slowly, sending a byte now and then (as HTTP/2 clients send window
    /// updates). Returns what the client read, and the error its reading or writing ended in.
    async fn download(size: usize, lingering: bool) -> (usize, Option<io::ErrorKind>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = respond_and_end(listener, size, lingering.then_some(Duration::from_secs(30)));
        let mut client = TcpStream::connect(addr).await.unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let (mut read, mut failed) = (0, None);
        let limit = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::time::Instant::now() < limit {
            if let Err(e) = client.write_all(b"u").await {
                failed = Some(e.kind());
                break;
            }
            match client.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(e) => {
                    failed = Some(e.kind());
                    break;
                }
            }
            // Slow enough that the server is done writing long before the client is reading.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        drop(client);
        server.await.unwrap();
        (read, failed)
    }

    #[tokio::test]
    async fn a_lingering_close_delivers_what_the_socket_still_held() {
        let size = 4 << 20;
        assert_eq!(download(size, true).await, (size, None));
    }

    /// The reason for lingering, shown: closing outright with the client's bytes unread
    /// resets the connection, and what the socket still held is lost.
    #[tokio::test]
    async fn closing_outright_with_bytes_unread_loses_the_tail() {
        let size = 4 << 20;
        let (read, failed) = download(size, false).await;
        assert!(read < size, "read {read} of {size}");
        assert!(
            matches!(
                failed,
                Some(io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe)
            ),
            "{failed:?}"
        );
    }

    /// A client's socket and the gateway's, connected over loopback.
    async fn connected() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        (client, listener.accept().await.unwrap().0)
    }

    /// How long [`linger`] with these bounds and no cut took.
    async fn lingered(stream: TcpStream, max: Duration, flush: Duration) -> Duration {
        let start = tokio::time::Instant::now();
        linger(stream, max, flush, std::future::pending()).await;
        start.elapsed()
    }

    /// A listener with room for a whole 128 KiB response on the gateway's side, and a client
    /// socket with little: most of a response stays unsent until the client reads.
    fn narrow() -> (TcpListener, tokio::net::TcpSocket) {
        let listening = tokio::net::TcpSocket::new_v4().unwrap();
        listening.set_send_buffer_size(256 * 1024).unwrap();
        listening.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let connecting = tokio::net::TcpSocket::new_v4().unwrap();
        connecting.set_recv_buffer_size(4096).unwrap();
        (listening.listen(8).unwrap(), connecting)
    }

    /// A client silent for longer than the idle wait while the end of its download is still
    /// in the gateway's socket (its window is full: it is not reading), that then sends a byte
    /// (an HTTP/2 window update) and reads the rest, gets all of it. Shutting down at once and
    /// closing after the idle wait, the byte arriving after the close was answered with a reset
    /// that threw the unsent tail away (review: slow HTTP/2 readers lost ~330 KB at shutdown).
    #[tokio::test(start_paused = true)]
    async fn a_reader_silent_past_the_idle_wait_still_gets_the_tail() {
        let size = 128 * 1024;
        let (listener, connecting) = narrow();
        let addr = listener.local_addr().unwrap();
        let server = respond_and_end(listener, size, Some(Duration::from_secs(60)));
        let mut client = connecting.connect(addr).await.unwrap();
        tokio::time::sleep(LINGER_IDLE + Duration::from_secs(1)).await;
        client.write_all(b"u").await.unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        let (mut read, mut failed) = (0, None);
        loop {
            match client.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(e) => {
                    failed = Some(e.kind());
                    break;
                }
            }
        }
        drop(client);
        server.await.unwrap();
        assert_eq!((read, failed), (size, None));
    }

    /// A client that stopped reading for good holds a lingering close for the send timeout
    /// (`flush`) at most, as it would hold a response still being written.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_reads_is_let_go_after_the_send_timeout() {
        let (listener, connecting) = narrow();
        let client = connecting
            .connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut stream, _) = listener.accept().await.unwrap();
        stream.write_all(&vec![7u8; 128 * 1024]).await.unwrap();
        let flush = Duration::from_secs(20);
        assert_eq!(
            lingered(stream, Duration::from_secs(10), flush).await,
            flush
        );
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_closes_is_let_go_after_the_idle_wait() {
        let (client, stream) = connected().await;
        let max = Duration::from_secs(30);
        assert_eq!(lingered(stream, max, max).await, LINGER_IDLE);
        drop(client);
    }

    /// A client that keeps sending, a byte at a time, is let go after `max` (the header
    /// timeout): one request does not buy a place for longer than an idle connection holds
    /// one (review: a byte every 4 s held a place for 30 s).
    #[tokio::test(start_paused = true)]
    async fn a_client_trickling_bytes_is_let_go_after_the_max() {
        let (mut client, stream) = connected().await;
        let trickle = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                if client.write_all(b"x").await.is_err() {
                    break;
                }
            }
            client
        });
        let max = Duration::from_secs(10);
        assert_eq!(lingered(stream, max, max).await, max);
        drop(trickle.await.unwrap());
    }
}
