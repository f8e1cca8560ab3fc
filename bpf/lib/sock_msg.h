/* SPDX-License-Identifier: Apache-2.0 */
/* The socket layer's sk_msg half (docs/socklayer.md): the alignment state
 * machine that keeps the program at frame boundaries, per-frame accounting,
 * and where a frame goes (its own peer, a weighted lane, or TCP).  The
 * registration half and the shared helpers are in sock.h. */
#ifndef MM_SOCK_MSG_H
#define MM_SOCK_MSG_H

#include "sock.h"

/* Verifier: clang turns a copy loop with a masked index into pointer
 * increments and drops the mask (the loop bound makes it redundant in C),
 * and the verifier cannot bound those pointers.  Hiding the index from the
 * optimiser keeps the mask in the code. */
#define MM_OPAQUE(x) asm volatile("" : "+r"(x))

enum mm_frame_status {
	MM_FRAME_OK = 0,
	MM_FRAME_SPLIT = 1,   /* the header continues in the next message: carried over */
	MM_FRAME_NOT_MMH = 2, /* no MMH magic at the boundary */
	MM_FRAME_BAD = 3,     /* MMH magic, but the header breaks a reading rule */
};

struct mm_frame {
	__u32 len;  /* header + payload */
	__u32 rest; /* of which from this message's first byte on: what the verdict covers */
	__u8 modality;
	__u8 cls;
};

/* Appends message bytes [from, to) to the header being assembled in the
 * scratch buffer at offset n.  Returns the new n, or 0 if the bytes cannot
 * be read.  Verifier: every packet access is checked against data_end, and
 * the scratch offset is masked into the buffer. */
static __always_inline __u32 mm_sock_take(struct sk_msg_md *msg, struct mm_scratch *sc, __u32 n,
					  __u32 from, __u32 to)
{
	__u8 *d, *de;
	__u32 i;

	if (to <= from)
		return n;
	if (bpf_msg_pull_data(msg, 0, to, 0))
		return 0;
	d = msg->data;
	de = msg->data_end;
	for (i = 0; i < MM_HDR_MAX; i++) {
		__u32 j = from + i, o = n + i;

		if (j >= to)
			break;
		MM_OPAQUE(j);
		MM_OPAQUE(o);
		j &= MM_SCRATCH_MASK;
		if (d + j + 1 > de)
			return 0;
		sc->buf[o & MM_SCRATCH_MASK] = d[j];
	}
	return n + (to - from);
}

/* The alignment state machine (docs/socklayer.md).  The program runs at a
 * frame boundary, or, when the header of the frame in progress was split
 * across messages, at the start of the message that continues it: then the
 * header bytes seen so far are in st->carry (st->carry_len of them).  This
 * assembles carry + message bytes in the scratch buffer and checks the
 * header by the reading rules of docs/wire-format.md section 3 (steps 1-7
 * without 7k, as the TC classifier applies them):
 * MM_FRAME_OK (f filled; f->rest = bytes of the frame from this message's
 * first byte on), MM_FRAME_SPLIT (still incomplete: saved into the carry),
 * MM_FRAME_NOT_MMH or MM_FRAME_BAD. */
static __always_inline int mm_sock_header(struct sk_msg_md *msg, struct mm_sock_state *st,
					  struct mm_scratch *sc, struct mm_frame *f)
{
	__u32 k = st->carry_len, size = msg->size, n, e1, e2, hl, pl, i;

	/* Verifier: the carry never holds a whole header; bounded for the loops. */
	if (k >= MM_HDR_MAX)
		return MM_FRAME_BAD;
	for (i = 0; i < MM_HDR_MAX; i++) {
		__u32 o = i;

		if (i >= k)
			break;
		MM_OPAQUE(o);
		sc->buf[o & MM_SCRATCH_MASK] = st->carry[o & (MM_SOCK_CARRY_SIZE - 1)];
	}
	e1 = k < MM_PREAMBLE_LEN ? MM_PREAMBLE_LEN - k : 0;
	if (e1 > size)
		e1 = size;
	n = mm_sock_take(msg, sc, k, 0, e1);
	if (!n)
		return MM_FRAME_NOT_MMH;
#pragma unroll
	for (i = 0; i < 4; i++) {
		if (i >= n)
			break;
		if (sc->buf[i] != ((MM_MAGIC_V1 >> (24 - 8 * i)) & 0xff))
			return i == 3 ? MM_FRAME_BAD : MM_FRAME_NOT_MMH; /* byte 3: the version */
	}
	if (n < MM_PREAMBLE_LEN)
		goto split;
	hl = sc->buf[MM_OFF_HDR_LEN];
	pl = mm_rd32(sc->buf, MM_OFF_PAYLOAD_LEN);
	if (hl < MM_PREAMBLE_LEN || pl > MM_MAX_PAYLOAD)
		return MM_FRAME_BAD;
	e2 = e1 + (hl > n ? hl - n : 0);
	if (e2 > size)
		e2 = size;
	n = mm_sock_take(msg, sc, n, e1, e2);
	if (!n)
		return MM_FRAME_BAD;
	if (n < hl)
		goto split;
	__builtin_memset(&sc->out, 0, sizeof(sc->out));
	if (mm_walk_tlvs(sc->buf, hl, &sc->out) != MM_HDR_OK)
		return MM_FRAME_BAD;
	f->len = hl + pl;
	f->rest = f->len - k;
	f->modality = sc->buf[MM_OFF_MODALITY];
	f->cls = sc->buf[MM_OFF_CLASS];
	return MM_FRAME_OK;
split:
	for (i = 0; i < MM_HDR_MAX; i++) {
		__u32 o = i;

		if (i >= n)
			break;
		MM_OPAQUE(o);
		st->carry[o & (MM_SOCK_CARRY_SIZE - 1)] = sc->buf[o & MM_SCRATCH_MASK];
	}
	st->carry_len = n;
	return MM_FRAME_SPLIT;
}

static __always_inline void mm_sock_count(struct mm_sock_state *st, struct mm_sock_stats *stats,
					  const struct mm_frame *f)
{
	__u32 m = f->modality < MM_SOCK_NR_MOD - 1 ? f->modality : MM_SOCK_NR_MOD - 1;
	__u32 c = f->cls < MM_MAX_CLASSES ? f->cls : 0;

	st->last_modality = f->modality;
	st->last_class = f->cls;
	st->mod[m].frames++;
	st->mod[m].bytes += f->len;
	stats->mod[f->modality].frames++;
	stats->mod[f->modality].bytes += f->len;
	stats->cls[c].frames++;
	stats->cls[c].bytes += f->len;
	mm_sock_ev(stats, MM_SE_FRAMES, 1);
	mm_sock_ev(stats, MM_SE_FRAME_BYTES, f->len);
}

/* Where a frame went, once its length is known. */
static __always_inline void mm_sock_tally(struct mm_sock_state *st, struct mm_sock_stats *stats,
					  int redirected, __u32 len)
{
	if (redirected) {
		st->redirected++;
		mm_sock_ev(stats, MM_SE_REDIRECTED, 1);
		mm_sock_ev(stats, MM_SE_REDIRECTED_BYTES, len);
	} else {
		st->passed++;
		mm_sock_ev(stats, MM_SE_PASSED, 1);
		mm_sock_ev(stats, MM_SE_PASSED_BYTES, len);
	}
}

/* Smooth weighted round robin (nginx): every replica with a weight gains its
 * weight, the one ahead is picked and loses the total.  Deterministic, and
 * over any sum-of-weights frames each replica gets exactly its share. */
static __always_inline __u32 mm_sock_swrr(struct mm_sock_state *st, const struct mm_sock_weights *w)
{
	__s32 total = 0, best_v = 0;
	__u32 best = MM_SOCK_NO_PICK;
	int i;

#pragma unroll
	for (i = 0; i < MM_SOCK_MAX_REPLICAS; i++) {
		__u32 wi = w->w[i];

		if (!wi) {
			st->swrr[i] = 0;
			continue;
		}
		if (wi > MM_SOCK_MAX_WEIGHT)
			wi = MM_SOCK_MAX_WEIGHT;
		st->swrr[i] += wi;
		total += wi;
		if (best == MM_SOCK_NO_PICK || st->swrr[i] > best_v) {
			best = i;
			best_v = st->swrr[i];
		}
	}
	if (best != MM_SOCK_NO_PICK) {
		/* Verifier: the index is masked into the array. */
		st->swrr[best & (MM_SOCK_MAX_REPLICAS - 1)] -= total;
		st->weight = w->w[best & (MM_SOCK_MAX_REPLICAS - 1)];
	}
	return best;
}

/* A lane's target is usable when it is still registered and its own client
 * (the lane's connection) has never sent it TCP bytes. */
static __always_inline int mm_sock_lane_ok(const struct mm_sock_lane *lane)
{
	struct mm_sock_key client __attribute__((aligned(8))) = {};
	struct mm_sock_flow *f;

	if (!sock_flow_map.lookup((void *)&lane->peer))
		return 0;
	mm_sock_peer(&lane->peer, &client);
	f = sock_flow_map.lookup(&client);
	return f && !(f->flags & MM_SOCK_F_SENT_TCP);
}

/* Picks the redirect target of a weighted frame: 1 and *tgt set, 0 to use
 * the own peer, -1 to pass (another socket leads the group). */
static __always_inline int mm_sock_pick_lane(struct mm_sock_state *st, struct mm_sock_stats *stats,
					     const struct mm_sock_weights *w,
					     const struct mm_sock_key *self, struct mm_sock_key *tgt)
{
	struct mm_sock_lane_key lk = {};
	struct mm_sock_group empty = {};
	struct mm_sock_lane *lane;
	struct mm_sock_group *g;
	__u32 r;

	mm_sock_group(&lk.group, st->netns, self->laddr, st->stage);
	g = sock_group_map.lookup(&lk.group);
	if (!g) {
		sock_group_map.update(&lk.group, &empty);
		g = sock_group_map.lookup(&lk.group);
		if (!g)
			return 0;
	}
	if (g->lead != st->cookie) {
		__sync_val_compare_and_swap(&g->lead, 0, st->cookie);
		if (g->lead != st->cookie)
			return -1;
	}
	st->flags |= MM_SOCK_F_LEAD;
	r = mm_sock_swrr(st, w);
	if (r == MM_SOCK_NO_PICK)
		return 0;
	st->last_pick = r;
	lk.replica = r;
	lane = sock_lane_map.lookup(&lk);
	if (!lane || !mm_sock_lane_ok(lane)) {
		mm_sock_ev(stats, MM_SE_LANE_MISS, 1);
		return 0;
	}
	__builtin_memcpy(tgt, &lane->peer, sizeof(*tgt));
	return 1;
}

/* Marks the socket as having sent TCP bytes to its peer (the order guard). */
static __always_inline void mm_sock_sent_tcp(struct mm_sock_state *st, const struct mm_sock_key *self)
{
	struct mm_sock_flow *f;

	if (st->flags & MM_SOCK_F_SENT_TCP)
		return;
	st->flags |= MM_SOCK_F_SENT_TCP;
	f = sock_flow_map.lookup((void *)self);
	if (f)
		f->flags |= MM_SOCK_F_SENT_TCP;
}

/* Decides where the frame that starts here goes and gives the verdict:
 * redirected into a local socket (1, *tgt set) or over TCP (0; the pass
 * reason is counted).  ``lanes``: a weighted pick is allowed (the whole
 * header is in this message). */
static __always_inline int mm_sock_route(struct sk_msg_md *msg, struct mm_sock_state *st,
					 struct mm_sock_stats *stats, const struct mm_sock_config *cfg,
					 struct mm_sock_key *tgt, int lanes)
{
	struct mm_sock_key self __attribute__((aligned(8))) = {};
	struct mm_sock_weights *w = 0;
	__u32 why = MM_SE_OFF;
	int lane = 0;
	long rc;

	MM_SOCK_KEY(msg, &self);
	if (!(cfg->flags & MM_SOCK_CFG_REDIRECT))
		goto pass;
	if (lanes && st->role == MM_SOCK_ROLE_CLIENT && st->stage)
		w = sock_weight_map.lookup(&st->stage);
	if (w) {
		lane = mm_sock_pick_lane(st, stats, w, &self, tgt);
		why = MM_SE_NOT_LEAD;
		if (lane < 0)
			goto pass;
	}
	if (!lane) {
		why = MM_SE_PEER_TCP;
		if (st->flags & MM_SOCK_F_SENT_TCP)
			goto pass;
		mm_sock_peer(&self, tgt);
		why = MM_SE_REMOTE;
		if (!sock_flow_map.lookup(tgt))
			goto pass;
	}
	/* bcc: its rewrite of a sockhash helper call ends in ';', so the result
	 * is taken in a statement of its own. */
	rc = sock_hash.msg_redirect_hash(msg, tgt, BPF_F_INGRESS);
	if (rc == SK_PASS)
		return 1;
	why = MM_SE_REDIRECT_FAILED;
pass:
	mm_sock_ev(stats, why, 1);
	mm_sock_sent_tcp(st, &self);
	return 0;
}

/* The verdict for bytes of a frame whose header was split: the same way as
 * its first bytes went (its own peer, or TCP). */
static __always_inline int mm_sock_carry_verdict(struct sk_msg_md *msg, struct mm_sock_state *st,
						 struct mm_sock_stats *stats)
{
	struct mm_sock_key tgt __attribute__((aligned(8))) = {};
	struct mm_sock_key self __attribute__((aligned(8))) = {};
	long rc;

	if (st->carry_mode == MM_SOCK_CARRY_REDIRECT) {
		__builtin_memcpy(&tgt, &st->carry_tgt, sizeof(tgt));
		rc = sock_hash.msg_redirect_hash(msg, &tgt, BPF_F_INGRESS);
		if (rc == SK_PASS)
			return 1;
		/* The target went away: the rest goes over TCP to the same socket,
		 * after what was redirected (order kept). */
		mm_sock_ev(stats, MM_SE_REDIRECT_FAILED, 1);
		st->carry_mode = MM_SOCK_CARRY_PASS;
	}
	MM_SOCK_KEY(msg, &self);
	mm_sock_sent_tcp(st, &self);
	return 0;
}

/* Fail open: the stream has no frame boundary we can find any more. */
static __always_inline __u32 mm_sock_unaligned(struct sk_msg_md *msg, struct mm_sock_state *st,
					     struct mm_sock_stats *stats)
{
	struct mm_sock_key self __attribute__((aligned(8))) = {};

	MM_SOCK_KEY(msg, &self);
	st->flags |= MM_SOCK_F_LOST;
	st->carry_len = 0;
	mm_sock_sent_tcp(st, &self);
	mm_sock_ev(stats, MM_SE_UNALIGNED, 1);
	mm_sock_ev(stats, MM_SE_UNALIGNED_BYTES, msg->size);
	return msg->size;
}

/* Returns how many bytes from the message's first one the verdict covers. */
static __always_inline __u32 mm_sock_msg_cover(struct sk_msg_md *msg)
{
	struct mm_sock_key tgt __attribute__((aligned(8))) = {};
	struct mm_sock_config *cfg;
	struct mm_sock_stats *stats;
	struct mm_sock_state *st;
	struct mm_scratch *sc;
	struct mm_frame f = {};
	__u32 zero = 0, carried;
	int r, redirected;

	stats = sock_stats_map.lookup(&zero);
	cfg = sock_config_map.lookup(&zero);
	sc = scratch_map.lookup(&zero);
	if (!stats || !cfg || !sc)
		return msg->size;
	st = sock_state_map.sk_storage_get(msg->sk, 0, 0);
	if (!st) {
		mm_sock_ev(stats, MM_SE_NO_STATE, 1);
		return msg->size;
	}
	if (!msg->size)
		return 0;
	if (st->flags & MM_SOCK_F_LOST)
		return mm_sock_unaligned(msg, st, stats);
	carried = st->carry_len;
	r = mm_sock_header(msg, st, sc, &f);
	if (r == MM_FRAME_NOT_MMH || r == MM_FRAME_BAD) {
		mm_sock_ev(stats, r == MM_FRAME_BAD ? MM_SE_MALFORMED : MM_SE_NOT_MMH, 1);
		return mm_sock_unaligned(msg, st, stats);
	}
	if (r == MM_FRAME_SPLIT) {
		if (!carried) {
			/* A new frame whose header is split: it goes to the own
			 * peer or over TCP, so that any fallback keeps the order. */
			mm_sock_ev(stats, MM_SE_SPLIT_HEADER, 1);
			st->carry_mode = mm_sock_route(msg, st, stats, cfg, &tgt, 0) ?
					 MM_SOCK_CARRY_REDIRECT : MM_SOCK_CARRY_PASS;
			__builtin_memcpy(&st->carry_tgt, &tgt, sizeof(tgt));
		} else {
			mm_sock_carry_verdict(msg, st, stats);
		}
		return msg->size;
	}
	mm_sock_count(st, stats, &f);
	if (carried) {
		st->carry_len = 0;
		redirected = mm_sock_carry_verdict(msg, st, stats);
	} else {
		redirected = mm_sock_route(msg, st, stats, cfg, &tgt, 1);
	}
	mm_sock_tally(st, stats, redirected, f.len);
	return f.rest;
}

/* The verdict covers exactly the bytes of the frame (or of the message) it
 * was taken for, whatever the sender's cuts: the program runs again at the
 * next frame's first byte.  Always set: the kernel keeps a message's
 * apply_bytes from one run of the program to the next on the same message. */
static __always_inline int mm_sock_msg(struct sk_msg_md *msg)
{
	bpf_msg_apply_bytes(msg, mm_sock_msg_cover(msg));
	return SK_PASS;
}

#endif /* MM_SOCK_MSG_H */
