/* SPDX-License-Identifier: Apache-2.0 */
/* The maps of the TC classifier.  Keys and values are defined in
 * include/mm_abi.h (generated from mmmesh/_abi.py); user space pins these
 * maps under /sys/fs/bpf/mmmesh/ and rewrites the policy maps in place. */
#ifndef MM_MAPS_H
#define MM_MAPS_H

#include "mm_abi.h"

/* Policy: written by user space, read by the programs. */
BPF_ARRAY(config_map, struct mm_config, 1);
BPF_ARRAY(class_map, struct mm_class_info, MM_MAX_CLASSES);
BPF_ARRAY(modality_map, struct mm_modality_info, MM_MAX_MODALITIES);
BPF_F_TABLE("lpm_trie", struct mm_src_key, struct mm_src_info, src_map,
	    MM_MAX_SRC_RULES, BPF_F_NO_PREALLOC);
/* Identifies a pinned dataplane (ABI version) for adoption. */
BPF_ARRAY(meta_map, struct mm_meta, 1);

/* State: TCP flows learnt from the segment that starts a message. */
BPF_TABLE("lru_hash", struct mm_flow_key, struct mm_flow_info, flow_map, MM_MAX_FLOWS);

/* Counters: key = direction (MM_DIR_*), one copy per CPU. */
BPF_PERCPU_ARRAY(stats_map, struct mm_stats, MM_NR_DIRS);

/* Scratch space for a whole MMH header (MM_HDR_MAX bytes).  512 bytes so that
 * an offset masked with 0x1ff is always inside the value: the mask is how the
 * verifier is shown that the TLV walk never reads out of bounds. */
#define MM_SCRATCH_SIZE 512
#define MM_SCRATCH_MASK (MM_SCRATCH_SIZE - 1)
/* Verifier: TLV results live in map memory, not on the stack.  Values the
 * verifier reads back from a map are unknown scalars, so the states of
 * different TLV orders merge; constant flags on the stack would multiply the
 * explored states by every combination of TLV types seen. */
struct mm_tlv_out {
	__u32 fps;
	__u32 bitrate;
	__u32 density;
	__u32 have;
	__u8 seen[16];
};
struct mm_scratch {
	__u8 buf[MM_SCRATCH_SIZE];
	struct mm_tlv_out out;
};
BPF_PERCPU_ARRAY(scratch_map, struct mm_scratch, 1);

#endif /* MM_MAPS_H */
