/* SPDX-License-Identifier: Apache-2.0 */
/* Egress mode fq: per-class pacing with earliest departure times (EDT).
 *
 * A class (or one of its boosts) with a pacing rate has a clock in pace_map:
 * where its next frame may start.  A frame takes the slot at the clock, and
 * moves the clock by its length at the rate; sch_fq (one per TX queue, under
 * mq) holds it until skb->tstamp.  So the class's frames leave, across every
 * CPU and TX queue, at no more than its rate, with no lock: one atomic add on
 * the class's clock.  A clock that lags behind now (the class sent less than
 * its rate) restarts at now, so an idle class gets no burst credit beyond one
 * frame.  A frame whose slot is further ahead than the class's horizon (its
 * backlog is full) does not take it: it is stamped PACE_DROP_NS ahead, past
 * sch_fq's own horizon, and the qdisc drops it, as an HTB leaf drops what its
 * full queue cannot take.  The classifier itself still returns TC_ACT_OK.
 * A departure time the sender already set (TCP's own EDT pacing) is kept
 * when it is later than the class's slot. */
#ifndef MM_PACE_H
#define MM_PACE_H

#include "compat.h"
#include "maps.h"

static __always_inline void mm_pace(struct __sk_buff *skb, __u32 slot, __u64 rate_Bps,
				    __u32 horizon_us, __u8 *flags)
{
	struct mm_pace_state *ps;
	__u64 now, len, delay, start;

	if (!rate_Bps)
		return;
	slot &= MM_PACE_SLOTS - 1;
	ps = pace_map.lookup(&slot);
	if (!ps)
		return;
	now = bpf_ktime_get_ns();
	len = skb->wire_len ? skb->wire_len : skb->len; /* GSO: every segment's headers */
	delay = len * MM_NSEC_PER_SEC / rate_Bps;
	/* Idle: the clock restarts at now.  Racy only while the class is below
	 * its rate (two CPUs may both restart it): at most a frame early. */
	if (ps->next_ns < now)
		ps->next_ns = now;
	/* Busy: each frame takes its slot with one atomic add, exact across CPUs. */
	start = __sync_fetch_and_add(&ps->next_ns, delay);
	if (start < now)
		start = now;
	if (start - now > (__u64)horizon_us * 1000) {
		/* The class's backlog is full: give the slot back, let the qdisc drop. */
		__sync_fetch_and_add(&ps->next_ns, -delay);
		ps->over_horizon++; /* approximate (plain add), like the flow counters */
		skb->tstamp = now + MM_PACE_DROP_NS;
		*flags |= MM_CBF_PACED | MM_CBF_OVER_HORIZON;
		return;
	}
	if (start > now && start > skb->tstamp)
		skb->tstamp = start;
	*flags |= MM_CBF_PACED;
}

#endif /* MM_PACE_H */
