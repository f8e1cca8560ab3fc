/* SPDX-License-Identifier: Apache-2.0 */
/* mmmesh TC classifier: entry points only, the logic is in lib/ headers.
 * Attached with clsact (direct-action) on the node's uplink.  Both programs
 * always return TC_ACT_OK: traffic they cannot read passes as best effort. */
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>

#include "lib/classify.h"

int mm_egress(struct __sk_buff *skb)
{
	return mm_classify(skb, MM_DIR_EGRESS);
}

int mm_ingress(struct __sk_buff *skb)
{
	return mm_classify(skb, MM_DIR_INGRESS);
}
