//! The main stream's timeline (`KVDIFF_CUDA_TRACE=1`): a timed event before and after every
//! operation, read once at the end, so a run shows where the GPU sat idle waiting for the host
//! and which operation it waited for. Unlike `KVDIFF_CUDA_PROFILE` nothing is synchronised,
//! so host and GPU overlap as in a normal run (decode steps are launched one by one, without
//! CUDA graphs, and the events between kernels cost programmatic dependent launch its overlap).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

/// Events made up front: creating one per operation would slow the host being measured.
const EVENTS: usize = 1 << 16;

pub struct Trace {
    /// `KVDIFF_CUDA_TRACE=graphs`: decode steps stay in CUDA graphs, each replay traced as
    /// one operation, so the timeline is the one a plain run has.
    graphs: bool,
    events: Vec<CudaEvent>,
    /// Per operation: name, its two events, and when the host enqueued it.
    ops: Vec<(String, usize, Instant)>,
}

impl Trace {
    pub fn from_env(ctx: &Arc<CudaContext>) -> Option<Trace> {
        let mode = std::env::var_os("KVDIFF_CUDA_TRACE").filter(|v| v != "0")?;
        let events = (0..EVENTS)
            .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        Some(Trace {
            graphs: mode == "graphs",
            events,
            ops: Vec::new(),
        })
    }

    pub fn keeps_graphs(&self) -> bool {
        self.graphs
    }

    /// Runs `f` (which enqueues on `stream`) between two events, while events last.
    pub fn around<R>(
        &mut self,
        stream: &CudaStream,
        name: impl FnOnce() -> String,
        f: impl FnOnce() -> R,
    ) -> R {
        let at = 2 * self.ops.len();
        if at + 2 > self.events.len() {
            return f();
        }
        let host = Instant::now();
        let ok = self.events[at].record(stream).is_ok();
        let r = f();
        if ok && self.events[at + 1].record(stream).is_ok() {
            self.ops.push((name(), at, host));
        }
        r
    }

    /// The timeline's table (`summarize`), once every event has completed.
    pub fn report(&self) -> Option<String> {
        let (_, first, _) = self.ops.first()?;
        let t0 = &self.events[*first];
        let at = |i: usize| t0.elapsed_ms(&self.events[i]).unwrap_or(f32::NAN) as f64;
        let ops: Vec<Op> = self
            .ops
            .iter()
            .map(|(name, e, host)| Op {
                name: name.clone(),
                start: at(*e),
                end: at(*e + 1),
                host: crate::support::timing::offset_ms(*host),
            })
            .collect();
        let mut out = summarize(&ops);
        if 2 * (self.ops.len() + 1) > self.events.len() {
            out += &format!(
                "  (events ran out: operations after the first {} were not traced)\n",
                self.ops.len()
            );
        }
        Some(out)
    }
}

/// One traced operation: GPU start and end (ms after the first operation started) and when
/// the host enqueued it (ms after main started).
pub struct Op {
    pub name: String,
    pub start: f64,
    pub end: f64,
    pub host: f64,
}

/// Busy and idle time of the stream, the idle time by the operation the GPU waited for (what
/// the host was late with), busy time by operation, and a timeline in 5 ms slices (with the
/// host's time of the first operation enqueued in each, to match `KVDIFF_TIMING`'s phases).
pub fn summarize(ops: &[Op]) -> String {
    let mut busy = 0.0;
    let mut idle = 0.0;
    let mut by_op: BTreeMap<&str, (u64, f64)> = BTreeMap::new();
    let mut idle_by_next: BTreeMap<&str, (u64, f64)> = BTreeMap::new();
    let mut slices: BTreeMap<u64, (f64, f64, f64)> = BTreeMap::new();
    let mut prev_end = 0.0;
    // (gap, op, host time the previous operation was enqueued): the host's work between the
    // two enqueues is what the GPU waited for.
    let mut waits: Vec<(f64, &Op, f64)> = Vec::new();
    let mut prev_host = ops.first().map_or(0.0, |o| o.host);
    for op in ops {
        let gap = (op.start - prev_end).max(0.0);
        if gap > 0.2 {
            waits.push((gap, op, prev_host));
        }
        prev_host = op.host;
        let o = by_op.entry(&op.name).or_insert((0, 0.0));
        o.0 += 1;
        o.1 += op.end - op.start;
        // Gaps of a few microseconds are the events' own cost, not the host being late.
        if gap > 0.005 {
            let g = idle_by_next.entry(&op.name).or_insert((0, 0.0));
            g.0 += 1;
            g.1 += gap;
        }
        busy += op.end - op.start;
        idle += gap;
        let slice = slices
            .entry((op.start / 5.0) as u64)
            .or_insert((0.0, 0.0, op.host));
        slice.0 += op.end - op.start;
        slice.1 += gap;
        prev_end = op.end;
    }
    let mut out = format!(
        "CUDA trace (main stream): {:.1} ms from the first operation to the last, {:.1} ms busy, {:.1} ms idle before operations, {} operations\n",
        prev_end,
        busy,
        idle,
        ops.len()
    );
    out += "  idle before (GPU waiting for the host), by the operation that ended the wait:\n";
    let mut idle_rows: Vec<_> = idle_by_next.into_iter().collect();
    idle_rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    for (k, (n, t)) in idle_rows.iter().take(12) {
        out += &format!("    {k:<34} {n:>6} waits {t:>9.2} ms\n");
    }
    waits.sort_by(|a, b| b.0.total_cmp(&a.0));
    if !waits.is_empty() {
        out += "  longest waits: ms idle, before which operation, when the GPU got to it (ms after the first operation), the host's enqueues around it (ms after main started):\n";
    }
    for (gap, op, before) in waits.iter().take(16) {
        out += &format!(
            "    {gap:>6.2} ms before {:<34} at {:>7.1}  host {before:>7.1} .. {:>7.1}\n",
            op.name, op.start, op.host
        );
    }
    out += "  busy by operation:\n";
    let mut rows: Vec<_> = by_op.into_iter().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    for (k, (n, t)) in rows.iter().take(60) {
        out += &format!(
            "    {k:<34} {n:>6} x {t:>9.2} ms {:>8.1} us\n",
            t * 1e3 / *n as f64
        );
    }
    out += "  5 ms slices of GPU time: busy, idle (ms), host ms after main started:\n";
    for (k, (b, i, h)) in slices {
        out += &format!("    {:>6} ms  {b:>5.2} {i:>5.2}  host {h:>8.1}\n", k * 5);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(name: &str, start: f64, end: f64, host: f64) -> Op {
        Op {
            name: name.into(),
            start,
            end,
            host,
        }
    }

    /// The indented lines under the line starting with `header`.
    fn section<'a>(s: &'a str, header: &str) -> Vec<&'a str> {
        s.lines()
            .skip_while(|l| !l.starts_with(header))
            .skip(1)
            .take_while(|l| l.starts_with("    "))
            .collect()
    }

    #[test]
    fn idle_time_is_charged_to_the_operation_that_ended_the_wait() {
        // a runs 0-2 ms; b waits 3 ms for the host, runs 5-6; a again right after (a 1 us
        // gap, the events' cost); c waits 4 ms, 11-12.
        let ops = [
            op("a", 0.0, 2.0, 100.0),
            op("b", 5.0, 6.0, 104.0),
            op("a", 6.001, 7.0, 104.5),
            op("c", 11.0, 12.0, 110.0),
        ];
        let s = summarize(&ops);
        assert!(
            s.starts_with(
                "CUDA trace (main stream): 12.0 ms from the first operation to the last, 5.0 ms busy, 7.0 ms idle before operations, 4 operations"
            ),
            "{s}"
        );
        let idle = section(&s, "  idle before");
        assert_eq!(idle.len(), 2, "{s}");
        assert!(
            idle[0].trim_start().starts_with('c') && idle[0].contains("4.00 ms"),
            "{s}"
        );
        assert!(
            idle[1].trim_start().starts_with('b') && idle[1].contains("3.00 ms"),
            "{s}"
        );
        // a's two runs: 2.999 ms busy in 2 calls.
        assert!(
            s.lines().any(|l| l.trim_start().starts_with("a ")
                && l.contains("2 x")
                && l.contains("3.00 ms")),
            "{s}"
        );
        // Slices: 0-5 ms holds a (2 ms busy); 5-10 b and the second a; 10-15 c and its wait.
        let slices: Vec<&str> = s
            .lines()
            .skip_while(|l| !l.contains("5 ms slices"))
            .skip(1)
            .collect();
        assert_eq!(slices.len(), 3, "{s}");
        assert!(slices[0].contains("2.00  0.00  host    100.0"), "{s}");
        assert!(slices[1].contains("2.00  3.00  host    104.0"), "{s}");
        assert!(slices[2].contains("1.00  4.00  host    110.0"), "{s}");
        // The longest waits, longest first, each with the host's enqueues around it: c was
        // enqueued at 110 ms, the operation before it at 104.5.
        let waits = section(&s, "  longest waits");
        assert_eq!(waits.len(), 2, "{s}");
        assert!(
            waits[0].contains("4.00 ms before c") && waits[0].contains("host   104.5 ..   110.0"),
            "{s}"
        );
        assert!(
            waits[1].contains("3.00 ms before b") && waits[1].contains("host   100.0 ..   104.0"),
            "{s}"
        );
    }
}
