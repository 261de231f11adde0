//! A token held by several programs of one group at once.
//!
//! The token is a group's, not a program's: while a group holds a device
//! and no other group waits for it, the group's other programs that ask
//! are served at once, each until the holder's grant ends, instead of
//! waiting their turn behind it. The device runs their work side by side
//! (a real GPU time-slices contexts), and the ledger charges the group
//! the time any of them occupied, once (`ledger`: claims of one group
//! that overlap are not charged twice), so the group's share, its
//! `MaxUtil` credit and the other groups' turns are as if one program had
//! run all of that work.
//!
//! Without it, programs of one group that start together (a job's
//! workers, a pool of inference servers) got the device one after
//! another, each for its whole first token: 64 programs of one 10 µs
//! kernel each took +82-149 ms at the median from exec to their first
//! kernel's end, as the median one waited for about 32 others' tenures.
//!
//! Where it does not apply, the token is one program's, as it was:
//! - another group waits (the holder, `gem-holder`, aside: it is served
//!   only when no program waits), or is about to ask again
//!   (`Device::returning`), or a reservation keeps the group off the
//!   device: the grant's ranking decides who runs next, and a program
//!   that joined would queue work into that group's time;
//! - the token ends by design (lent, or its end announced): it is about
//!   to pass on;
//! - less than `min_quota` of it is left: the program waits for the next
//!   token instead of getting a short one;
//! - the holder or the program asking is a rank of a declared job, whose
//!   turns (`gang`) count on one rank per token, or not a program.

use super::tokens::note_grant;
use super::{Action, Client, Device, Grant, GroupKey, Micros, Params, reserve};
use gemini_protocol::{ClientId, DeviceId, Reply, Role};
use std::collections::BTreeMap;

/// Serves the waiters of `dev` (device `device`) of the token holder's
/// group, where the token can be shared (see the module doc): each gets
/// the rest of the holder's grant, to end with it.
pub(super) fn share(
    dev: &mut Device,
    clients: &mut BTreeMap<ClientId, Client>,
    reserved: &[&str],
    params: &Params,
    device: DeviceId,
    now: Micros,
    out: &mut Vec<Action>,
) {
    let Some((group, end, expires_at)) = shareable(dev, clients, reserved, device) else {
        return;
    };
    let quota = end.saturating_sub(now);
    if quota < params.min_quota {
        return;
    }
    let mut i = 0;
    while i < dev.waiters.len() {
        let w = &dev.waiters[i];
        let joins = w.group == group
            && clients
                .get(&w.client)
                .is_some_and(|c| c.role == Role::Client && c.job.is_none());
        if !joins {
            i += 1;
            continue;
        }
        let w = dev.waiters.remove(i);
        let Some(c) = clients.get_mut(&w.client) else {
            continue;
        };
        note_grant(dev, c, device, (now, quota), false, params.window);
        dev.shared.push(Grant {
            client: w.client,
            expires_at,
            ends: false,
            runs_out_at: None,
        });
        out.push(Action::Reply {
            client: w.client,
            seq: w.seq,
            reply: Reply::Token {
                device,
                quota_us: quota,
                lent: false,
                last_step: false,
                held_us: now.saturating_sub(w.since),
            },
        });
    }
}

/// Whether `dev`'s token may be shared now (see the module doc): its
/// holder's group, the end of the holder's grant (its quota's) and the
/// token's expiry.
fn shareable(
    dev: &Device,
    clients: &BTreeMap<ClientId, Client>,
    reserved: &[&str],
    device: DeviceId,
) -> Option<(GroupKey, Micros, Micros)> {
    let t = dev
        .token
        .as_ref()
        .filter(|t| !t.ends && t.runs_out_at.is_none())?;
    let holder = clients
        .get(&t.client)
        .filter(|c| c.role == Role::Client && c.job.is_none())?;
    let group = &holder.group;
    let other = |k: &GroupKey| k != group && *k != GroupKey::Holder;
    if reserve::kept_out(reserved, group)
        || dev.waiters.iter().any(|w| other(&w.group))
        || dev.returning.as_ref().is_some_and(|r| other(&r.group))
    {
        return None;
    }
    let &(granted_at, quota) = holder.granted.get(&device)?;
    Some((
        group.clone(),
        granted_at.saturating_add(quota),
        t.expires_at,
    ))
}
