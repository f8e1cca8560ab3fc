/* SPDX-License-Identifier: Apache-2.0 */
/* L2-L4 parsing: Ethernet (+ up to MM_MAX_VLAN 802.1Q/802.1ad tags), IPv4
 * (with options, fragments), IPv6 (bounded extension header walk), TCP (with
 * options) and UDP.  Fills struct mm_pkt.  Never fails the packet: anything
 * it cannot read leaves has_l4 == 0 and the caller passes it as best effort. */
#ifndef MM_PARSE_H
#define MM_PARSE_H

#include "compat.h"

struct mm_pkt {
	__u32 l3_off;     /* offset of the IP header */
	__u32 pay_off;    /* offset of the L4 payload */
	__u32 pay_len;    /* payload bytes present in this skb */
	__u32 dgram_len;  /* UDP: payload bytes of the whole datagram (udp->len - 8) */
	__u8 l3;          /* 4, 6, or 0 when not IP */
	__u8 has_l4;      /* TCP or UDP header read */
	__u8 tos;         /* IPv4 TOS / IPv6 traffic class */
	__u8 tcp_fin_rst; /* TCP segment with FIN or RST: the flow ends */
	struct mm_flow_key key; /* addresses IPv4-mapped, ports be */
};

struct mm_vlan_hdr {
	__be16 tci;
	__be16 proto;
};

/* IPv6 extension header walk.  Extension headers are rare, so they are read
 * with bpf_skb_load_bytes() on a scalar offset: simpler for the verifier than
 * packet pointers that grow by up to 2 KiB per iteration. */
static __always_inline int mm_walk_ipv6_ext(struct __sk_buff *skb, __u8 *nexthdr, __u32 *off)
{
	__u8 nh = *nexthdr;
	__u32 o = *off;
	int i;

#pragma unroll
	for (i = 0; i < MM_MAX_EXTHDRS; i++) {
		__u8 eh[4];

		if (nh != MM_IPPROTO_HOPOPTS && nh != MM_IPPROTO_ROUTING &&
		    nh != MM_IPPROTO_DSTOPTS && nh != MM_IPPROTO_FRAGMENT && nh != MM_IPPROTO_AH)
			break;
		if (bpf_skb_load_bytes(skb, o, eh, sizeof(eh)) < 0)
			return -1;
		if (nh == MM_IPPROTO_FRAGMENT) {
			/* eh[2..3]: offset (13 bits) | res | M.  Only the first
			 * fragment carries the L4 header. */
			if (((eh[2] << 8) | eh[3]) & 0xFFF8)
				return -1;
			o += 8;
		} else if (nh == MM_IPPROTO_AH) {
			o += ((__u32)eh[1] + 2) * 4;
		} else {
			o += ((__u32)eh[1] + 1) * 8;
		}
		nh = eh[0];
	}
	/* Still an extension header after MM_MAX_EXTHDRS: give up (best effort). */
	if (nh == MM_IPPROTO_HOPOPTS || nh == MM_IPPROTO_ROUTING || nh == MM_IPPROTO_DSTOPTS ||
	    nh == MM_IPPROTO_FRAGMENT || nh == MM_IPPROTO_AH)
		return -1;
	*nexthdr = nh;
	*off = o;
	return 0;
}

static __always_inline void mm_parse(struct __sk_buff *skb, struct mm_pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	__u32 off = sizeof(struct ethhdr);
	__u16 proto;
	__u32 l3_end = skb->len, tot;
	__u8 l4proto;
	int i;

	if ((void *)(eth + 1) > data_end)
		return;
	proto = eth->h_proto;

#pragma unroll
	for (i = 0; i < MM_MAX_VLAN; i++) {
		struct mm_vlan_hdr *vh;

		if (proto != MM_HTONS(MM_ETH_P_8021Q) && proto != MM_HTONS(MM_ETH_P_8021AD))
			break;
		vh = data + off;
		if ((void *)(vh + 1) > data_end)
			return;
		proto = vh->proto;
		off += sizeof(struct mm_vlan_hdr);
	}

	if (proto == MM_HTONS(MM_ETH_P_IP)) {
		struct iphdr *ip = data + off;
		__u32 ihl;

		if ((void *)(ip + 1) > data_end)
			return;
		ihl = ip->ihl * 4;
		if (ihl < sizeof(struct iphdr))
			return;
		p->l3 = 4;
		p->l3_off = off;
		p->tos = ip->tos;
		p->key.saddr[10] = 0xff;
		p->key.saddr[11] = 0xff;
		p->key.daddr[10] = 0xff;
		p->key.daddr[11] = 0xff;
		__builtin_memcpy(&p->key.saddr[12], &ip->saddr, 4);
		__builtin_memcpy(&p->key.daddr[12], &ip->daddr, 4);
		/* Non-first fragments carry no L4 header. */
		if (ip->frag_off & MM_HTONS(0x1FFF))
			return;
		l4proto = ip->protocol;
		tot = MM_NTOHS(ip->tot_len);
		/* tot_len is 0 in BIG TCP super-packets: use the skb length. */
		if (tot >= ihl && off + tot <= skb->len)
			l3_end = off + tot;
		off += ihl;
	} else if (proto == MM_HTONS(MM_ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = data + off;
		__u8 *b = (__u8 *)ip6;

		if ((void *)(ip6 + 1) > data_end)
			return;
		p->l3 = 6;
		p->l3_off = off;
		p->tos = ((b[0] & 0x0f) << 4) | (b[1] >> 4);
		__builtin_memcpy(p->key.saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->key.daddr, &ip6->daddr, 16);
		l4proto = ip6->nexthdr;
		tot = MM_NTOHS(ip6->payload_len);
		if (tot && off + sizeof(struct ipv6hdr) + tot <= skb->len)
			l3_end = off + sizeof(struct ipv6hdr) + tot;
		off += sizeof(struct ipv6hdr);
		if (mm_walk_ipv6_ext(skb, &l4proto, &off) < 0)
			return;
	} else {
		return;
	}

	/* Verifier: bound the scalar before adding it to a packet pointer. */
	if (off > MM_MAX_L4_OFF)
		return;

	if (l4proto == MM_IPPROTO_TCP) {
		struct tcphdr *th = data + off;
		__u32 doff;

		if ((void *)(th + 1) > data_end)
			return;
		doff = th->doff * 4;
		if (doff < sizeof(struct tcphdr))
			return;
		p->key.sport = th->source;
		p->key.dport = th->dest;
		p->tcp_fin_rst = th->fin | th->rst;
		p->pay_off = off + doff;
		/* l3_end, not skb->len: ingress frames may carry L2 padding. */
		p->pay_len = l3_end > p->pay_off ? l3_end - p->pay_off : 0;
	} else if (l4proto == MM_IPPROTO_UDP) {
		struct udphdr *uh = data + off;
		__u32 ulen;

		if ((void *)(uh + 1) > data_end)
			return;
		p->key.sport = uh->source;
		p->key.dport = uh->dest;
		p->pay_off = off + sizeof(struct udphdr);
		ulen = MM_NTOHS(uh->len);
		p->pay_len = ulen > sizeof(struct udphdr) ? ulen - sizeof(struct udphdr) : 0;
		p->dgram_len = p->pay_len;
		/* Bytes of it in this skb (the first fragment holds only part). */
		if (l3_end < p->pay_off)
			p->pay_len = 0;
		else if (p->pay_len > l3_end - p->pay_off)
			p->pay_len = l3_end - p->pay_off;
	} else {
		return;
	}
	p->key.proto = l4proto;
	p->has_l4 = 1;
}

#endif /* MM_PARSE_H */
