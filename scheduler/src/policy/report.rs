//! Reports of device time: what a client says its work on a device
//! occupied, charged to its group (see `ledger`), each span clipped to
//! what can be.

use super::{Action, Client, Device, Micros, Policy, limits};
use gemini_protocol::{ClientId, DeviceId, Span};

/// The most spans a report is charged span by span (see `charge_spans`).
const MAX_REPORT_SPANS: usize = 64;

/// How far (µs) a report may pass what can be (the time now, what the
/// client was charged before, its token's grant) before it counts as
/// impossible: the two sides round their clocks to µs.
const CLOCK_SLACK: Micros = 1_000;

/// What a client's report on one device can hold (see
/// [`Policy::charge_spans`]).
#[derive(Debug)]
struct CanBe {
    /// The end of the device time it was charged before (0: none).
    until: Micros,
    /// The grant of its oldest token whose work may not be reported yet
    /// (the time now where there is none).
    anchor: Micros,
    /// The start of the window: nothing before is charged.
    horizon: Micros,
    now: Micros,
}

/// The time a report charged, from when, and why it was clipped, if it
/// was.
#[derive(Debug)]
struct Charged {
    time: Micros,
    /// The start of the first span charged.
    first: Micros,
    /// The first span clipped, what could be, and why it could not.
    clipped: Option<String>,
}

impl Policy {
    /// `client` reports the work of its last token on `device` (`ran`,
    /// measured; `in_flight`: some of it still runs and is reported
    /// later): charges it, and frees the device if it still holds the
    /// token.
    pub(super) fn report(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ran: &[Span],
        in_flight: bool,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        let token = c.uncharged.remove(&device);
        let lent = c.lent.remove(&device);
        let dev = self.devices.entry(device).or_default();
        dev.take_back(client);
        let charged = self.charge_spans(client, device, ran, Proof::Ran, now, out);
        if !in_flight && let Some(c) = self.clients.get_mut(&client) {
            c.anchor.remove(&device);
        }
        // An overrun token's use is one launch or more (a 2 ms token whose
        // two 1 ms kernels ran 2.05 ms is two): the estimate follows a
        // shorter one at once, a longer one by an eighth.
        if let Some((granted_at, quota)) = token
            && let Some(c) = self.clients.get_mut(&client)
        {
            let used = ran
                .iter()
                .map(|s| s.end_us.min(now).saturating_sub(s.start_us.max(granted_at)))
                .sum::<Micros>()
                .max(charged.min(now.saturating_sub(granted_at)));
            if used > quota {
                c.launch_floor = match c.launch_floor {
                    0 => used,
                    f if used <= f => used,
                    f => f + (used - f) / 8,
                };
            }
            if lent {
                c.long_launch = if used > quota { used } else { 0 };
            }
        }
    }

    /// Charges `client`'s group the device time of `ran` on `device`
    /// (see `ledger`), each span clipped to what can be: not before the
    /// grant of the client's oldest token whose work it had not reported,
    /// nor before what it was charged already (never twice), nor in the
    /// future, nor before the window. A clipped report is said once in
    /// the log (and counted). Returns the time charged.
    pub(super) fn charge_spans(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ran: &[Span],
        proof: Proof,
        now: Micros,
        out: &mut Vec<Action>,
    ) -> Micros {
        if ran.is_empty() {
            return 0;
        }
        // A hook sends at most 32 spans a report, the holder 64;
        // more is charged as one span over all of them (the client's
        // loss), so that no client has the ledger settle spans by the
        // thousand.
        let joined;
        let ran = if ran.len() > MAX_REPORT_SPANS {
            joined = [Span {
                start_us: ran.iter().map(|s| s.start_us).min().unwrap_or(0),
                end_us: ran.iter().map(|s| s.end_us).max().unwrap_or(0),
            }];
            &joined[..]
        } else {
            ran
        };
        let Policy {
            clients,
            devices,
            config,
            retired,
            params,
            ..
        } = self;
        let Some(c) = clients.get_mut(&client) else {
            return 0;
        };
        // A client with no token here before (this scheduler restarted
        // under it) may report what it ran before: clipped, not said.
        let known = c.anchor.contains_key(&device) || c.charged_until.contains_key(&device);
        let until = c.charged_until.get(&device).copied().unwrap_or(0);
        // No token granted whose work is unreported: nothing can have run,
        // unless the client ran here under the scheduler before this one,
        // whose last token may have run on after this one started (its
        // first report here: from this scheduler's start, the spans of
        // before it rebased to 0).
        // As an anchor: work it says is still in flight is taken from
        // there too, at its next report.
        if c.restored.remove(&device) && !known {
            c.anchor.insert(device, 0);
        }
        let can = CanBe {
            until,
            anchor: c.anchor.get(&device).copied().unwrap_or(now),
            horizon: now.saturating_sub(params.window),
            now,
        };
        let dev = devices.entry(device).or_default();
        dev.ledger.forget_before(can.horizon);
        let charged = claim_spans(c, dev, device, ran, &can, proof, params.saved_credit());
        let used = c.gpu_used.entry(device).or_default();
        *used = used.saturating_add(charged.time);
        // The report's credit at once (see `Device::claim`); a report that
        // charged nothing (all clipped, or none ran) looks up no limits.
        if charged.time > 0 {
            let max_util = limits(config, retired, &c.group).max_util;
            let cap = params.saved_credit();
            dev.charge_credit(&c.group, charged.first, now, charged.time, max_util, cap);
        }
        if let Some(what) = charged.clipped
            && known
        {
            note_clipped(c, client, device, what, out);
        }
        charged.time
    }

    /// Charges work of `client` that ran on `device` after the token it
    /// was launched under ended
    /// ([`Request::LateUsage`](gemini_protocol::Request::LateUsage)): the
    /// work it gave back in flight is done.
    pub(super) fn late(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ran: &[Span],
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        self.charge_spans(client, device, ran, Proof::Ran, now, out);
        // The work it gave back in flight is done: what it may not have
        // reported yet is that of a token granted since, if any (an
        // anchor left at the old grant would have its exit charged, as an
        // estimate, from there to that grant's end and the grace).
        if let Some(c) = self.clients.get_mut(&client) {
            c.in_flight.remove(&device);
            match c.uncharged.get(&device) {
                Some(&(granted_at, _)) => c.anchor.insert(device, granted_at),
                None => c.anchor.remove(&device),
            };
        }
    }
}

/// Claims for `c`'s group, on `dev` (device `device`), each span of `ran`
/// clipped to what can be (`can`), without its `MaxUtil` credit (charged
/// once for the report, see `Device::claim`); `cap`: the credit's cap.
fn claim_spans(
    c: &mut Client,
    dev: &mut Device,
    device: DeviceId,
    ran: &[Span],
    can: &CanBe,
    proof: Proof,
    cap: Micros,
) -> Charged {
    let mut from = can.until.max(can.anchor);
    let mut charged = Charged {
        time: 0,
        first: 0,
        clipped: None,
    };
    for s in ran {
        if charged.clipped.is_none() {
            charged.clipped = impossible(s, from, can);
        }
        let (start, end) = (s.start_us.max(from).max(can.horizon), s.end_us.min(can.now));
        if end <= start {
            continue;
        }
        // From where its last span ended: work queued behind that
        // one, outstanding since it was.
        let since = match c.stretch.get(&device) {
            Some(&since) if s.start_us <= from && from > can.anchor => since,
            _ => start,
        };
        let estimated = proof == Proof::Outstanding;
        let claimed = dev.claim((&c.group, c.uid), (start, end), since, cap, estimated);
        if claimed > 0 && charged.time == 0 {
            charged.first = start;
        }
        charged.time += claimed;
        from = end;
        // An estimate is not what was charged: a measured span reported
        // after it, of earlier work, is still charged (the ledger keeps
        // the estimate from counting its time twice).
        if !estimated {
            c.charged_until.insert(device, end);
            c.stretch.insert(device, since);
        }
    }
    charged
}

/// What a report's spans say of the client's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Proof {
    /// It ran there: measured, settled against other groups' claims by
    /// the ledger's rules.
    Ran,
    /// It was outstanding there, not proven to run
    /// ([`Request::UnprovenUsage`](gemini_protocol::Request::UnprovenUsage)):
    /// charged only where no measured claim has the time (an estimate).
    Outstanding,
}

/// Why span `s` cannot be, if it cannot: it ends in the future, or
/// begins before `from` (where what can be begins: the end of what its
/// client was charged, or its oldest unreported token's grant). Rounding
/// to µs on both sides is not an impossible report ([`CLOCK_SLACK`]).
fn impossible(s: &Span, from: Micros, can: &CanBe) -> Option<String> {
    let now = can.now;
    if !(s.start_us.saturating_add(CLOCK_SLACK) < from
        || s.end_us > now.saturating_add(CLOCK_SLACK))
    {
        return None;
    }
    Some(format!(
        "{}-{} us, where {from}-{now} us can be ({})",
        s.start_us,
        s.end_us,
        if s.end_us > now.saturating_add(CLOCK_SLACK) {
            "in the future"
        } else if s.start_us < can.until {
            "reported already"
        } else {
            "before its token"
        }
    ))
}

/// Counts a clipped report of `c` (connection `client`) on `device`, and
/// says it (`what`) at the 1st, 2nd, 4th, … of them.
fn note_clipped(
    c: &mut Client,
    client: ClientId,
    device: DeviceId,
    what: String,
    out: &mut Vec<Action>,
) {
    c.clipped += 1;
    if c.clipped.is_power_of_two() {
        out.push(Action::Clipped {
            client,
            device,
            reports: c.clipped,
            what,
        });
    }
}
