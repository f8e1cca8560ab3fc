/* SPDX-License-Identifier: Apache-2.0 */
/* The socket layer (docs/socklayer.md).
 *
 * sockops (attached to the mesh pods' cgroup v2): an established TCP socket
 * whose connection ends at a mesh endpoint (sock_ep_map) goes into sock_hash
 * (the SOCKHASH the sk_msg program is attached to), gets socket storage
 * (cookie, stage, replica, counters) and a registry entry (sock_flow_map);
 * a client socket also becomes its group's lane to that replica.  At
 * TCP_CLOSE the registry entry, the lane and a lead claim go; the kernel
 * removes the socket from sock_hash by itself.
 *
 * sk_msg (lib/sock_msg.h): runs at frame boundaries only.  It reads the MMH
 * header at the start of the message, calls bpf_msg_apply_bytes(header +
 * payload), so that its verdict covers exactly that frame however the sender
 * cuts it into sendmsg calls, and the kernel runs it again at the next
 * frame's first byte.  A header split across messages is carried over in
 * socket storage until it is whole.  A boundary without a valid header loses
 * the alignment for good: the socket passes everything over TCP from then on
 * (fail open, counted).  Every frame is counted (socket storage and per-CPU
 * stats) and either redirected into the ingress queue of a local socket or
 * passed over TCP.
 *
 * Order guard: a socket that received bytes over TCP from its peer must never
 * receive redirected bytes afterwards (the reader takes its redirect queue
 * first, so a redirected frame would overtake, or cut into, TCP bytes not yet
 * read).  So a socket that passes anything marks itself SENT_TCP, and its peer
 * is never a redirect target again.  Redirected bytes followed by TCP bytes
 * keep their order, so switching off is safe at any time. */
#ifndef MM_SOCK_H
#define MM_SOCK_H

/* The TC classifier's maps are not part of this object: mm_maps.h (which
 * maps.h includes for the classifier) is skipped, and this object declares
 * the one map lib/mmh.h names, scratch_map, in mm_sock_maps.h. */
#define MM_MAPS_H
#include "mm_abi.h"
#include "mm_sock_maps.h"
#include "mmh.h"

/* bcc 0.26 declares bpf_get_socket_cookie() as returning u32: the upper
 * half of the cookie would be lost.  The netns cookie is declared here too
 * (not every bcc knows it). */
static __u64 (*mm_socket_cookie)(void *ctx) = (void *)BPF_FUNC_get_socket_cookie;
static __u64 (*mm_netns_cookie)(void *ctx) = (void *)BPF_FUNC_get_netns_cookie;

#define MM_SOCK_TCP_CLOSE 7 /* BPF_TCP_CLOSE */

#define mm_sock_ev(stats, ev, n) ((stats)->events[(ev)] += (n))

static __always_inline void mm_put32(__u8 *p, __u32 v)
{
	__builtin_memcpy(p, &v, sizeof(v));
}

/* An address as 16 bytes: IPv4 (and IPv4-mapped IPv6) as ::ffff:a.b.c.d.
 * Returns the family the key records (MM_AF_INET for both IPv4 forms). */
static __always_inline __u8 mm_sock_addr(__u8 *out, __u32 family, __u32 ip4, __u32 w0, __u32 w1,
					 __u32 w2, __u32 w3)
{
	if (family == MM_AF_INET || (w0 == 0 && w1 == 0 && w2 == MM_HTONL(0xffff))) {
		mm_put32(out, 0);
		mm_put32(out + 4, 0);
		mm_put32(out + 8, MM_HTONL(0xffff));
		mm_put32(out + 12, family == MM_AF_INET ? ip4 : w3);
		return MM_AF_INET;
	}
	mm_put32(out, w0);
	mm_put32(out + 4, w1);
	mm_put32(out + 8, w2);
	mm_put32(out + 12, w3);
	return MM_AF_INET6;
}

/* The socket's own key, from a struct bpf_sock_ops or struct sk_msg_md (the
 * fields have the same names).  Local port: host order; remote port: network
 * order in the upper half of the u32.  Verifier: each ctx field is read at a
 * constant offset, as the ctx rewriter requires, so this is a macro. */
#define MM_SOCK_KEY(ctx, k)                                                              \
	do {                                                                             \
		__u32 fam_ = (ctx)->family;                                              \
		(k)->family = mm_sock_addr((k)->laddr, fam_, (ctx)->local_ip4,           \
					   (ctx)->local_ip6[0], (ctx)->local_ip6[1],     \
					   (ctx)->local_ip6[2], (ctx)->local_ip6[3]);    \
		mm_sock_addr((k)->raddr, fam_, (ctx)->remote_ip4, (ctx)->remote_ip6[0],  \
			     (ctx)->remote_ip6[1], (ctx)->remote_ip6[2],                  \
			     (ctx)->remote_ip6[3]);                                       \
		(k)->lport = (__u16)(ctx)->local_port;                                   \
		(k)->rport = (__u16)MM_NTOHL((ctx)->remote_port);                        \
	} while (0)

/* The key of the socket at the other end of the same connection. */
static __always_inline void mm_sock_peer(const struct mm_sock_key *k, struct mm_sock_key *p)
{
	__builtin_memcpy(p->laddr, k->raddr, sizeof(p->laddr));
	__builtin_memcpy(p->raddr, k->laddr, sizeof(p->raddr));
	p->lport = k->rport;
	p->rport = k->lport;
	p->family = k->family;
}

/* The endpoint at (addr, port), else the address-wide one (port 0). */
static __always_inline struct mm_sock_ep *mm_sock_ep(const __u8 *addr, __u16 port)
{
	struct mm_sock_ep_key ek = {};
	struct mm_sock_ep *ep;

	__builtin_memcpy(ek.addr, addr, sizeof(ek.addr));
	ek.port = port;
	ep = sock_ep_map.lookup(&ek);
	if (ep || !port)
		return ep;
	ek.port = 0;
	return sock_ep_map.lookup(&ek);
}

static __always_inline void mm_sock_group(struct mm_sock_group_key *g, __u64 netns,
					  const __u8 *laddr, __u32 stage)
{
	g->netns = netns;
	__builtin_memcpy(g->addr, laddr, sizeof(g->addr));
	g->stage = stage;
	g->pad = 0;
}

/* ----------------------------------------------------------- sockops */
static __always_inline void mm_sock_register(struct bpf_sock_ops *skops, __u8 role,
					     struct mm_sock_stats *stats)
{
	struct mm_sock_key k __attribute__((aligned(8))) = {};
	struct mm_sock_flow flow = {};
	struct mm_sock_ep *conn, *other;
	struct mm_sock_state *st;
	struct mm_sock_config *cfg;
	struct bpf_sock *sk;
	__u32 zero = 0;
	long rc;

	cfg = sock_config_map.lookup(&zero);
	if (!cfg || !(cfg->flags & MM_SOCK_CFG_REGISTER))
		return;
	if (skops->family != MM_AF_INET && skops->family != MM_AF_INET6)
		return;
	MM_SOCK_KEY(skops, &k);
	/* The connection's endpoint is the server's side of it. */
	if (role == MM_SOCK_ROLE_CLIENT) {
		conn = mm_sock_ep(k.raddr, k.rport);
		other = mm_sock_ep(k.laddr, 0);
	} else {
		conn = mm_sock_ep(k.laddr, k.lport);
		other = mm_sock_ep(k.raddr, 0);
	}
	if (!conn && !(cfg->flags & MM_SOCK_CFG_ALL)) {
		mm_sock_ev(stats, MM_SE_SKIPPED, 1);
		return;
	}
	sk = skops->sk;
	if (!sk)
		return;
	st = sock_state_map.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		mm_sock_ev(stats, MM_SE_HASH_FULL, 1);
		return;
	}
	flow.cookie = mm_socket_cookie(skops);
	flow.netns = mm_netns_cookie(skops);
	flow.established_ns = bpf_ktime_get_ns();
	flow.stage = conn ? conn->stage : 0;
	flow.replica = conn ? conn->replica : 0;
	flow.peer_stage = other ? other->stage : 0;
	flow.role = role;
	__builtin_memset(st, 0, sizeof(*st));
	st->cookie = flow.cookie;
	st->netns = flow.netns;
	st->stage = flow.stage;
	st->replica = flow.replica;
	st->peer_stage = flow.peer_stage;
	st->role = role;
	st->last_pick = MM_SOCK_NO_PICK;
	/* Registry first: an sk_msg that finds the socket in sock_hash finds its
	 * entry too. */
	if (sock_flow_map.update(&k, &flow) != 0) {
		mm_sock_ev(stats, MM_SE_HASH_FULL, 1);
		return;
	}
	/* bcc: its rewrite of a sockhash helper call ends in ';', so the result
	 * is taken in a statement of its own. */
	rc = sock_hash.sock_hash_update(skops, &k, BPF_ANY);
	if (rc != 0) {
		sock_flow_map.delete(&k);
		mm_sock_ev(stats, MM_SE_HASH_FULL, 1);
		return;
	}
	if (role == MM_SOCK_ROLE_CLIENT && flow.stage && flow.replica < MM_SOCK_MAX_REPLICAS) {
		struct mm_sock_lane_key lk = {};
		struct mm_sock_lane lane = {};

		mm_sock_group(&lk.group, flow.netns, k.laddr, flow.stage);
		lk.replica = flow.replica;
		mm_sock_peer(&k, &lane.peer);
		lane.cookie = flow.cookie;
		sock_lane_map.update(&lk, &lane); /* the newest connection is the lane */
	}
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	mm_sock_ev(stats, MM_SE_REGISTERED, 1);
}

static __always_inline void mm_sock_unregister(struct bpf_sock_ops *skops, struct mm_sock_stats *stats)
{
	struct mm_sock_key k __attribute__((aligned(8))) = {};
	struct mm_sock_group_key gk = {};
	struct mm_sock_lane_key lk = {};
	struct mm_sock_flow *f;
	struct mm_sock_lane *lane;
	struct mm_sock_group *g;
	__u64 cookie, netns;
	__u32 stage, replica;
	__u8 role;

	if (skops->family != MM_AF_INET && skops->family != MM_AF_INET6)
		return;
	MM_SOCK_KEY(skops, &k);
	f = sock_flow_map.lookup(&k);
	if (!f)
		return;
	cookie = f->cookie;
	netns = f->netns;
	stage = f->stage;
	replica = f->replica;
	role = f->role;
	sock_flow_map.delete(&k);
	mm_sock_ev(stats, MM_SE_REMOVED, 1);
	if (role != MM_SOCK_ROLE_CLIENT || !stage)
		return;
	mm_sock_group(&gk, netns, k.laddr, stage);
	g = sock_group_map.lookup(&gk);
	if (g)
		__sync_val_compare_and_swap(&g->lead, cookie, 0);
	lk.group = gk;
	lk.replica = replica;
	lane = sock_lane_map.lookup(&lk);
	if (lane && lane->cookie == cookie)
		sock_lane_map.delete(&lk);
}

static __always_inline void mm_sock_ops(struct bpf_sock_ops *skops)
{
	struct mm_sock_stats *stats;
	__u32 zero = 0;

	stats = sock_stats_map.lookup(&zero);
	if (!stats)
		return;
	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		mm_sock_register(skops, MM_SOCK_ROLE_CLIENT, stats);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		mm_sock_register(skops, MM_SOCK_ROLE_SERVER, stats);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] == MM_SOCK_TCP_CLOSE)
			mm_sock_unregister(skops, stats);
		break;
	default:
		break;
	}
}

#endif /* MM_SOCK_H */
