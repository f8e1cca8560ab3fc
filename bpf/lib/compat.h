/* SPDX-License-Identifier: Apache-2.0 */
/* Byte order and small helpers that bcc's built-in headers do not give us.
 * BPF targets here are little-endian (x86_64, arm64); big-endian builds would
 * need the identity versions. */
#ifndef MM_COMPAT_H
#define MM_COMPAT_H

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mmmesh BPF programs assume a little-endian target"
#endif

#define MM_HTONS(x) ((__be16)__builtin_bswap16((__u16)(x)))
#define MM_NTOHS(x) ((__u16)__builtin_bswap16((__u16)(x)))
#define MM_HTONL(x) ((__be32)__builtin_bswap32((__u32)(x)))
#define MM_NTOHL(x) ((__u32)__builtin_bswap32((__u32)(x)))

#define MM_ETH_P_IP 0x0800
#define MM_ETH_P_IPV6 0x86DD
#define MM_ETH_P_8021Q 0x8100
#define MM_ETH_P_8021AD 0x88A8

#define MM_IPPROTO_HOPOPTS 0
#define MM_IPPROTO_TCP 6
#define MM_IPPROTO_UDP 17
#define MM_IPPROTO_ROUTING 43
#define MM_IPPROTO_FRAGMENT 44
#define MM_IPPROTO_AH 51
#define MM_IPPROTO_DSTOPTS 60

/* L4 headers further into the packet than this are not looked at: it bounds
 * the packet-pointer arithmetic for the verifier (IPv4 options are <= 40
 * bytes, the IPv6 extension header walk is bounded by MM_MAX_EXTHDRS). */
#ifndef MM_MAX_L4_OFF
#define MM_MAX_L4_OFF 1024
#endif

/* Set to 1 to read the payload preamble with bpf_skb_load_bytes() even when
 * it is in the linear area: the tests use it to run the path that GSO
 * packets take on a real device through BPF_PROG_TEST_RUN, whose packets are
 * always linear. */
#ifndef MM_FORCE_SKB_LOAD
#define MM_FORCE_SKB_LOAD 0
#endif

/* Flow timestamps need ~ms resolution only: the coarse clock (kernel 5.11+)
 * is several times cheaper than bpf_ktime_get_ns() in a VM.  Declared here
 * because bcc 0.26 does not know the helper. */
static __u64 (*mm_ktime_get_coarse_ns)(void) = (void *)BPF_FUNC_ktime_get_coarse_ns;
#define mm_now_ns() mm_ktime_get_coarse_ns()

#endif /* MM_COMPAT_H */
