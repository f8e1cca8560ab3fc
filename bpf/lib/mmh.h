/* SPDX-License-Identifier: Apache-2.0 */
/* Reading the MMH header (docs/wire-format.md) at the start of an L4 payload.
 *
 * Bytes 0..7 are read first (directly when they are in the linear area, with
 * bpf_skb_load_bytes() otherwise: TCP GSO packets keep their payload in
 * frags).  Only if the magic and version match is the whole header (<= 255
 * bytes) copied into a per-CPU scratch buffer and its TLVs validated. */
#ifndef MM_MMH_H
#define MM_MMH_H

#include "compat.h"
#include "maps.h"
#include "parse.h"

enum mm_hdr_status {
	MM_HDR_NONE = 0, /* no MMH magic: not a mesh header */
	MM_HDR_OK = 1,
	MM_HDR_BAD = 2, /* magic present, header invalid */
};

#define MM_HAVE_FPS 0x1
#define MM_HAVE_BITRATE 0x2
#define MM_HAVE_DENSITY 0x4

struct mm_hdr {
	__u8 hdr_len;
	__u8 modality;
	__u8 sla_class;
	__u8 flags;
};

static __always_inline __u32 mm_rd16(const __u8 *b, __u32 o)
{
	return ((__u32)b[o & MM_SCRATCH_MASK] << 8) | b[(o + 1) & MM_SCRATCH_MASK];
}

static __always_inline __u32 mm_rd32(const __u8 *b, __u32 o)
{
	return ((__u32)b[o & MM_SCRATCH_MASK] << 24) | ((__u32)b[(o + 1) & MM_SCRATCH_MASK] << 16) |
	       ((__u32)b[(o + 2) & MM_SCRATCH_MASK] << 8) | b[(o + 3) & MM_SCRATCH_MASK];
}

/* What the walk needs to know of a TLV type, from one switch: the seen[]
 * slot of a known type (duplicates are malformed; -1 for PAD and unknown
 * types, which are skipped and may repeat) in bits 8..15 and its required
 * value length (MM_TLV_FIXED_UNSET = variable or unknown) in bits 0..7. */
#define MM_TLV_INFO(slot, len) ((((slot) & 0xff) << 8) | (len))
static __always_inline __u32 mm_tlv_info(__u8 t)
{
	switch (t) {
	case MM_TLV_STREAM_ID: return MM_TLV_INFO(0, 4);
	case MM_TLV_SEQUENCE: return MM_TLV_INFO(1, 8);
	case MM_TLV_TIMESTAMP_NS: return MM_TLV_INFO(2, 8);
	case MM_TLV_DEADLINE_NS: return MM_TLV_INFO(3, 8);
	case MM_TLV_VIDEO_FPS: return MM_TLV_INFO(4, 2);
	case MM_TLV_AUDIO_BITRATE: return MM_TLV_INFO(5, 4);
	case MM_TLV_POINT_DENSITY: return MM_TLV_INFO(6, 4);
	case MM_TLV_TENSOR: return MM_TLV_INFO(7, MM_TLV_FIXED_UNSET);
	case MM_TLV_TRACEPARENT: return MM_TLV_INFO(8, 26);
	case MM_TLV_ERROR: return MM_TLV_INFO(9, MM_TLV_FIXED_UNSET);
	default: return MM_TLV_INFO(0xff, MM_TLV_FIXED_UNSET);
	}
}

/* Walk and validate the TLVs of a header copied to buf[0..hdr_len). */
static __always_inline int mm_walk_tlvs(const __u8 *buf, __u32 hdr_len, struct mm_tlv_out *out)
{
	__u32 o = MM_PREAMBLE_LEN;
	int i;

	for (i = 0; i <= MM_MAX_TLVS; i++) {
		__u32 t, l, v, fixed, info, slot;

		if (o >= hdr_len)
			return MM_HDR_OK;
		if (i == MM_MAX_TLVS)
			return MM_HDR_BAD; /* too many TLVs */
		if (o + 2 > hdr_len)
			return MM_HDR_BAD; /* TLV header runs past the header */
		t = buf[o & MM_SCRATCH_MASK];
		l = buf[(o + 1) & MM_SCRATCH_MASK];
		v = o + 2;
		if (v + l > hdr_len)
			return MM_HDR_BAD; /* TLV value runs past the header */
		info = mm_tlv_info(t);
		fixed = info & 0xff;
		if (fixed != MM_TLV_FIXED_UNSET && l != fixed)
			return MM_HDR_BAD;
		slot = info >> 8;
		if (slot != 0xff) {
			if (out->seen[slot & 15])
				return MM_HDR_BAD; /* duplicate known TLV */
			out->seen[slot & 15] = 1;
		}
		if (slot == 0xff || slot < 4) {
			/* PAD, unknown, ids and times: nothing to read */
		} else if (t == MM_TLV_VIDEO_FPS) {
			out->fps = mm_rd16(buf, v);
			out->have |= MM_HAVE_FPS;
		} else if (t == MM_TLV_AUDIO_BITRATE) {
			out->bitrate = mm_rd32(buf, v);
			out->have |= MM_HAVE_BITRATE;
		} else if (t == MM_TLV_POINT_DENSITY) {
			out->density = mm_rd32(buf, v);
			out->have |= MM_HAVE_DENSITY;
		} else if (t == MM_TLV_TENSOR) {
			__u32 nd;

			if (l < 2)
				return MM_HDR_BAD;
			nd = buf[(v + 1) & MM_SCRATCH_MASK];
			if (nd > MM_TENSOR_MAX_DIMS || l != 2 + 4 * nd)
				return MM_HDR_BAD;
		} else if (t == MM_TLV_ERROR) {
			/* The message's UTF-8 is not checked here: the classifier
			 * validates structure, not the content of values. */
			if (l < 2)
				return MM_HDR_BAD;
		}
		o = v + l;
	}
	return MM_HDR_BAD; /* not reached: the loop returns */
}

/* Reads the header at the start of the payload.  On MM_HDR_OK, *h and *out
 * are filled (out points into the per-CPU scratch value). */
static __always_inline int mm_read_hdr(struct __sk_buff *skb, const struct mm_pkt *p,
				       struct mm_hdr *h, struct mm_tlv_out **outp)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 avail = p->pay_len;
	__u8 pre[8] = {};
	__u32 w, hl, zero = 0;
	struct mm_scratch *sc;
	struct mm_tlv_out *out;

	if (avail < 4) {
		/* UDP: a datagram of 1..3 bytes that are a prefix of the magic is
		 * a truncated header, as the decoder says.  TCP: short segments
		 * are continuation data of their flow, never a header. */
		__u8 i;

		if (avail == 0 || p->key.proto != MM_IPPROTO_UDP || bpf_skb_load_bytes(skb, p->pay_off, pre, 1) < 0 || pre[0] != 'M')
			return MM_HDR_NONE;
		if (avail >= 2 && (bpf_skb_load_bytes(skb, p->pay_off + 1, &i, 1) < 0 || i != 'M'))
			return MM_HDR_NONE;
		if (avail >= 3 && (bpf_skb_load_bytes(skb, p->pay_off + 2, &i, 1) < 0 || i != 'H'))
			return MM_HDR_NONE;
		return MM_HDR_BAD;
	}
	if (!MM_FORCE_SKB_LOAD && p->pay_off <= MM_MAX_L4_OFF + 60 &&
	    data + p->pay_off + sizeof(pre) <= data_end) {
		__builtin_memcpy(pre, data + p->pay_off, sizeof(pre));
	} else if (avail >= sizeof(pre)) {
		if (bpf_skb_load_bytes(skb, p->pay_off, pre, sizeof(pre)) < 0)
			return MM_HDR_NONE;
	} else {
		if (bpf_skb_load_bytes(skb, p->pay_off, pre, 4) < 0)
			return MM_HDR_NONE;
	}
	w = ((__u32)pre[0] << 24) | ((__u32)pre[1] << 16) | ((__u32)pre[2] << 8) | pre[3];
	if (w != MM_MAGIC_V1)
		return (w >> 8) == MM_MAGIC_U24 ? MM_HDR_BAD : MM_HDR_NONE;
	if (avail < MM_PREAMBLE_LEN)
		return MM_HDR_BAD; /* truncated preamble */
	hl = pre[MM_OFF_HDR_LEN];
	if (hl < MM_PREAMBLE_LEN || hl > avail)
		return MM_HDR_BAD; /* header length too short or past the packet */
	h->hdr_len = hl;
	h->modality = pre[MM_OFF_MODALITY];
	h->sla_class = pre[MM_OFF_CLASS];
	h->flags = pre[MM_OFF_FLAGS];

	sc = scratch_map.lookup(&zero);
	if (!sc)
		return MM_HDR_BAD;
	/* Verifier: the copy length must be provably within [1, sizeof buf]. */
	hl &= 0xff;
	if (hl < MM_PREAMBLE_LEN)
		return MM_HDR_BAD;
	if (bpf_skb_load_bytes(skb, p->pay_off, sc->buf, hl) < 0)
		return MM_HDR_BAD;
	if (mm_rd32(sc->buf, MM_OFF_PAYLOAD_LEN) > MM_MAX_PAYLOAD)
		return MM_HDR_BAD;
	/* A datagram holds exactly one frame: its payload must fit. */
	if (p->key.proto == MM_IPPROTO_UDP && (__u64)hl + mm_rd32(sc->buf, MM_OFF_PAYLOAD_LEN) > p->dgram_len)
		return MM_HDR_BAD;

	out = &sc->out;
	__builtin_memset(out, 0, sizeof(*out));
	*outp = out;
	return mm_walk_tlvs(sc->buf, hl, out);
}

#endif /* MM_MMH_H */
