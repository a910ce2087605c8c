//! Where the membership lives in the store: one place that names every key, so the
//! protocol's steps read as what they do.

/// The keys under one prefix.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Keys {
        Keys { prefix: prefix.trim_end_matches('/').to_string() }
    }
    /// A counter per rank: each process of the rank takes the next incarnation.
    pub(crate) fn incarnation(&self, rank: usize) -> String {
        format!("{}/incarnation/{rank}", self.prefix)
    }
    /// A rank's liveness record: `<incarnation> <beat count>`, renewed every beat.
    pub(crate) fn alive(&self, rank: usize) -> String {
        format!("{}/alive/{rank}", self.prefix)
    }
    /// Evidence that incarnation `inc` of `rank` is gone (its text says who saw what).
    pub(crate) fn gone(&self, rank: usize, inc: u64) -> String {
        format!("{}/gone/{rank}/{inc}", self.prefix)
    }
    /// A process of `rank` that waits to be admitted: its incarnation.
    pub(crate) fn joining(&self, rank: usize) -> String {
        format!("{}/joining/{rank}", self.prefix)
    }
    /// The newest decided epoch.
    pub(crate) fn current(&self) -> String {
        format!("{}/current", self.prefix)
    }
    /// Why epoch `e` is being agreed (the first reason given wins).
    pub(crate) fn proposed(&self, e: u64) -> String {
        format!("{}/epoch/{e}/proposed", self.prefix)
    }
    /// Present when epoch `e` is proposed because a process failed (its text: the first
    /// failure reported); absent for an epoch that only admits a joiner.
    pub(crate) fn failure(&self, e: u64) -> String {
        format!("{}/epoch/{e}/failure", self.prefix)
    }
    /// A member's arrival at epoch `e`: its incarnation.
    pub(crate) fn arrived(&self, e: u64, rank: usize) -> String {
        format!("{}/epoch/{e}/arrived/{rank}", self.prefix)
    }
    /// Who decides epoch `e`: `<rank> <incarnation>`.
    pub(crate) fn leader(&self, e: u64) -> String {
        format!("{}/epoch/{e}/leader", self.prefix)
    }
    /// Every member's arrival at epoch `e`, as a prefix.
    pub(crate) fn arrivals(&self, e: u64) -> String {
        format!("{}/epoch/{e}/arrived/", self.prefix)
    }
    /// Every key of epoch `e`, as a prefix.
    pub(crate) fn epoch(&self, e: u64) -> String {
        format!("{}/epoch/{e}/", self.prefix)
    }
    /// The decision of epoch `e` (a view, or the error every member gets).
    pub(crate) fn decision(&self, e: u64) -> String {
        format!("{}/epoch/{e}/decision", self.prefix)
    }
}
