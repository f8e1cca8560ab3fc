/* SPDX-License-Identifier: Apache-2.0 */
/* Policy lookup: header -> class id, source-rule clamp, flow table, override
 * (boost leaf), priority, pacing (egress mode fq), DSCP, counters.  The pure-Python reference of the
 * same semantics is mmmesh.policy.classify_reference() (the override step:
 * testkit/overrides.py); tests compare the two. */
#ifndef MM_CLASSIFY_H
#define MM_CLASSIFY_H

#include "compat.h"
#include "maps.h"
#include "parse.h"
#include "mmh.h"
#include "pace.h"

/* Header -> class id before clamping: a requested class that exists wins,
 * then the modality's metadata rules in order, then its fallback class, then
 * the policy's default class. */
static __always_inline __u32 mm_pick_class(const struct mm_hdr *h, const struct mm_tlv_out *tv,
					   const struct mm_config *cfg)
{
	struct mm_modality_info *mi;
	__u32 key;
	int i;

	if (h->sla_class && h->sla_class < MM_MAX_CLASSES) {
		struct mm_class_info *ci;

		key = h->sla_class;
		ci = class_map.lookup(&key);
		if (ci && ci->valid)
			return key;
	}
	key = h->modality;
	mi = modality_map.lookup(&key);
	if (mi && mi->valid) {
#pragma unroll
		for (i = 0; i < MM_MAX_RULES; i++) {
			const struct mm_rule *r = &mi->rules[i];
			__u32 v;

			if (i >= mi->nrules)
				break;
			if (r->meta == MM_META_FPS && (tv->have & MM_HAVE_FPS))
				v = tv->fps;
			else if (r->meta == MM_META_BITRATE && (tv->have & MM_HAVE_BITRATE))
				v = tv->bitrate;
			else if (r->meta == MM_META_DENSITY && (tv->have & MM_HAVE_DENSITY))
				v = tv->density;
			else
				continue;
			if (v >= r->min && v <= r->max)
				return r->class_id;
		}
		if (mi->default_class)
			return mi->default_class;
	}
	return cfg->default_class;
}

/* Lowers a claim above what the source prefix may claim (longest prefix
 * match on the source address).  The LPM lookup only runs when some source
 * rule could clamp a class of this rank. */
static __always_inline __u32 mm_clamp(const struct mm_pkt *p, const struct mm_config *cfg,
				      __u32 cid, __u8 *flags)
{
	struct mm_class_info *ci;
	struct mm_src_info *si;
	struct mm_src_key k = {};

	if (!(cfg->flags & MM_CFG_HAS_SRC_RULES))
		return cid;
	cid &= MM_MAX_CLASSES - 1;
	ci = class_map.lookup(&cid);
	if (!ci || !ci->valid || ci->rank >= cfg->clamp_below_rank)
		return cid;
	k.prefixlen = 128;
	__builtin_memcpy(k.addr, p->key.saddr, 16);
	si = src_map.lookup(&k);
	if (si && ci->rank < si->max_rank) {
		*flags |= MM_CBF_CLAMPED;
		return si->max_class;
	}
	return cid;
}

/* Overrides (docs/dataplane.md, "Per-flow and per-stage overrides"): the
 * boost level of a parsed egress frame of class cid (after the clamp): a flow
 * override of this 5-tuple for that class, else the longest stage override
 * (class, sender prefix); 0: none.  Only looked up when user space has loaded
 * some (cfg flags).  Hits are atomic: only frames with an override pay. */
static __always_inline __u8 mm_override(struct mm_pkt *p, const struct mm_config *cfg,
					__u32 cid)
{
	struct mm_ovr_info *ov = 0;

	if (cfg->flags & MM_CFG_FLOW_OVERRIDES) {
		ov = flow_ovr_map.lookup(&p->key);
		/* An override for another class: a source rule or the policy
		 * moved the flow since; the clamp wins. */
		if (ov && ov->class_id != cid)
			ov = 0;
	}
	if (!ov && (cfg->flags & MM_CFG_STAGE_OVERRIDES)) {
		struct mm_stage_ovr_key k = {};

		k.prefixlen = 32 + 128;
		k.class_id = cid;
		__builtin_memcpy(k.addr, p->key.saddr, 16);
		ov = stage_ovr_map.lookup(&k);
	}
	if (!ov || !ov->level || ov->level > MM_MAX_BOOSTS)
		return 0;
	__sync_fetch_and_add(&ov->hits, 1);
	return ov->level;
}

/* Boost level `level` of class cid (its skb->priority, pacer), 0 when that
 * leaf is not (or no longer) there: user space marks a boost valid only once
 * its leaf exists and invalidates it before deleting the leaf. */
static __always_inline struct mm_boost_info *mm_boost(__u32 cid, __u32 level)
{
	struct mm_boost_info *b;
	__u32 k;

	if (!level || level > MM_MAX_BOOSTS)
		return 0;
	k = (level - 1) * MM_MAX_CLASSES + (cid & (MM_MAX_CLASSES - 1));
	b = boost_map.lookup(&k);
	if (!b || !b->valid || !b->classid)
		return 0;
	return b;
}

/* Rewrites the DSCP bits, keeping ECN; IPv4 header checksum fixed
 * incrementally.  Invalidates packet pointers: call last. */
static __always_inline int mm_set_dscp(struct __sk_buff *skb, const struct mm_pkt *p, __u8 dscp)
{
	__u8 want = (dscp << 2) | (p->tos & 0x3);

	if (want == p->tos)
		return 0;
	if (p->l3 == 4) {
		if (bpf_l3_csum_replace(skb, p->l3_off + offsetof(struct iphdr, check),
					MM_HTONS(p->tos), MM_HTONS(want), 2) < 0)
			return 0;
		if (bpf_skb_store_bytes(skb, p->l3_off + 1, &want, 1, 0) < 0)
			return 0;
		return 1;
	}
	if (p->l3 == 6) {
		__u8 b[2];

		if (bpf_skb_load_bytes(skb, p->l3_off, b, 2) < 0)
			return 0;
		b[0] = (b[0] & 0xf0) | (want >> 4);
		b[1] = (b[1] & 0x0f) | ((want & 0x0f) << 4);
		if (bpf_skb_store_bytes(skb, p->l3_off, b, 2, 0) < 0)
			return 0;
		return 1;
	}
	return 0;
}

static __always_inline int mm_classify(struct __sk_buff *skb, const __u32 dir)
{
	struct mm_pkt p = {};
	struct mm_hdr h = {};
	struct mm_tlv_out *tv = 0;
	struct mm_config *cfg;
	struct mm_class_info *ci;
	struct mm_stats *st;
	struct mm_flow_info *fl = 0;
	__u32 zero = 0, reason = MM_R_NOT_MESH, cid, d = dir;
	__u32 boost_cid = 0; /* the class `boost` was chosen for */
	__u8 flags = 0, boost = 0;
	__u32 modality = MM_NO_MODALITY; /* a header's or flow's byte, or 0x100: none */
	int hs = MM_HDR_NONE;

	cfg = config_map.lookup(&zero);
	st = stats_map.lookup(&d);
	if (!cfg || !st)
		return TC_ACT_OK;
	cid = cfg->default_class;

	mm_parse(skb, &p);
	/* Egress and ingress flows never share an entry: an inbound segment must
	 * not be able to set the class of an outbound flow. */
	p.key.dir = dir;
	if (p.has_l4)
		hs = mm_read_hdr(skb, &p, &h, &tv);

	if (hs == MM_HDR_OK && tv) {
		reason = MM_R_PARSED;
		modality = h.modality;
		cid = mm_pick_class(&h, tv, cfg);
		cid = mm_clamp(&p, cfg, cid, &flags);
		/* The leaf is chosen here, at a frame's header: for TCP the start
		 * of a message, which the flow keeps for its other segments. */
		if (dir == MM_DIR_EGRESS && (cfg->flags & (MM_CFG_STAGE_OVERRIDES |
							   MM_CFG_FLOW_OVERRIDES)))
			boost = mm_override(&p, cfg, cid);
		boost_cid = cid;
		if (p.key.proto == MM_IPPROTO_TCP) {
			fl = flow_map.lookup(&p.key);
			if (!fl) {
				struct mm_flow_info nf = {};

				nf.last_seen_ns = mm_now_ns();
				nf.class_id = cid;
				nf.modality = h.modality;
				nf.boost = boost;
				flow_map.update(&p.key, &nf);
				fl = flow_map.lookup(&p.key);
				flags |= MM_CBF_FLOW_LEARNT;
				st->reason[MM_R_FLOW_NEW]++;
			} else if (fl->class_id != cid || fl->modality != h.modality) {
				fl->class_id = cid;
				fl->modality = h.modality;
				flags |= MM_CBF_FLOW_LEARNT;
				st->reason[MM_R_FLOW_UPDATE]++;
			}
			if (fl)
				fl->boost = boost;
		}
	} else if (p.has_l4 && p.key.proto == MM_IPPROTO_TCP) {
		/* No header (or, mid-flow, bytes that only look like a broken one:
		 * counted as malformed, but the flow keeps its class). */
		fl = flow_map.lookup(&p.key);
		if (fl) {
			reason = hs == MM_HDR_BAD ? MM_R_MALFORMED : MM_R_FLOW_HIT;
			modality = fl->modality;
			boost = fl->boost;
			boost_cid = fl->class_id;
			/* Source rules may have changed since the flow was learnt (then
			 * cid != boost_cid: the boost no longer applies). */
			cid = mm_clamp(&p, cfg, fl->class_id, &flags);
		} else if (hs == MM_HDR_BAD) {
			reason = MM_R_MALFORMED;
		}
	} else if (hs == MM_HDR_BAD) {
		reason = MM_R_MALFORMED;
	}
	if (fl) {
		/* Per-flow counters are approximate by design: plain increments,
		 * because a locked add per packet cost more than the rest of a flow
		 * hit.  A flow's segments rarely run on two CPUs at once; the
		 * per-class counters (per-CPU) are exact. */
		fl->last_seen_ns = mm_now_ns();
		fl->packets++;
		fl->bytes += skb->len;
		/* FIN/RST: the connection ends here; a reused 5-tuple starts clean. */
		if (p.tcp_fin_rst)
			flow_map.delete(&p.key);
	}

	cid &= MM_MAX_CLASSES - 1;
	ci = class_map.lookup(&cid);
	if (!ci || !ci->valid) {
		/* A class removed by a newer policy: fall back to the default. */
		cid = cfg->default_class & (MM_MAX_CLASSES - 1);
		ci = class_map.lookup(&cid);
	}
	if (ci && ci->valid) {
		/* Egress only: on ingress, a priority that equals an HTB class id
		 * would follow forwarded packets to other devices' qdiscs. */
		if (dir == MM_DIR_EGRESS) {
			struct mm_boost_info *b = boost && cid == boost_cid ? mm_boost(cid, boost) : 0;

			/* HTB: the leaf's class id; egress mode fq: the band's priomap slot. */
			skb->priority = b ? b->classid : ci->classid;
			if (b)
				flags |= MM_CBF_BOOSTED;
			/* Egress mode fq: the frame's pacer is its leaf's (the class's own,
			 * or the boost's, which has a share of the class's ceil). */
			if (cfg->flags & MM_CFG_PACING) {
				if (b)
					mm_pace(skb, boost * MM_MAX_CLASSES + cid, b->pace_Bps,
						b->horizon_us, &flags);
				else
					mm_pace(skb, cid, ci->pace_Bps, ci->horizon_us, &flags);
			}
			if (ci->dscp != MM_DSCP_KEEP && p.l3 && mm_set_dscp(skb, &p, ci->dscp)) {
				flags |= MM_CBF_DSCP;
				st->reason[MM_R_DSCP_REWRITE]++;
			}
		}
	} else {
		cid = 0; /* no policy loaded: leave the packet alone */
	}

	if (flags & MM_CBF_CLAMPED)
		st->reason[MM_R_CLAMPED]++;
	st->reason[reason & (MM_NR_REASONS - 1)]++;
	/* Verifier: cid is bounded above, but with the pacer's registers clang
	 * spills it as a u32 and reloads it; 6.12's verifier does not keep the
	 * bound of that spill (6.18's does).  The mask shows it again. */
	cid &= MM_MAX_CLASSES - 1;
	st->cls[cid].packets++;
	st->cls[cid].bytes += skb->len;

	/* Verdict metadata for BPF_PROG_TEST_RUN and debugging; cb[] at TC is
	 * the qdisc_skb_cb data area that belongs to BPF. */
	skb->cb[MM_CB_REASON] = reason;
	skb->cb[MM_CB_CLASS] = cid;
	skb->cb[MM_CB_MODALITY] = modality;
	skb->cb[MM_CB_FLAGS] = flags;
	return TC_ACT_OK;
}

#endif /* MM_CLASSIFY_H */
