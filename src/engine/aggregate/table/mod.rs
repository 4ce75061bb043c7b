//! Generic tables the gate keeps its counters and call ids in: a slab of
//! values by place ([`Slab`]) and a bounded memory of the last entries put
//! ([`Recent`]).

mod recent;
mod slab;

pub(crate) use recent::Recent;
pub(crate) use slab::Slab;
