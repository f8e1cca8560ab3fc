/* SPDX-License-Identifier: Apache-2.0 */
/* mmmesh socket layer: entry points only, the logic is in lib/sock.h
 * (sockops) and lib/sock_msg.h (sk_msg).
 * mm_sockops is attached to the mesh pods' cgroup v2 (BPF_CGROUP_SOCK_OPS),
 * mm_sk_msg to sock_hash (BPF_SK_MSG_VERDICT).  Both fail open: a socket or
 * a message they cannot read is left to TCP. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>

#include "lib/sock_msg.h"

int mm_sockops(struct bpf_sock_ops *skops)
{
	mm_sock_ops(skops);
	return 1;
}

int mm_sk_msg(struct sk_msg_md *msg)
{
	return mm_sock_msg(msg);
}
