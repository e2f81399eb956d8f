//! sluice's shared store on Redis: one Lua round trip per decision.
