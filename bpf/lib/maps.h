/* SPDX-License-Identifier: Apache-2.0 */
/* The maps of the TC classifier.  Their declarations are generated from
 * mmmesh/abi.py (MAPS) into include/mm_maps.h, with the key and value
 * layouts in include/mm_abi.h; user space pins these maps under
 * /sys/fs/bpf/mmmesh/ and rewrites the policy maps in place. */
#ifndef MM_LIB_MAPS_H
#define MM_LIB_MAPS_H

#include "mm_maps.h"

/* Verifier: an offset into the scratch buffer (MM_SCRATCH_SIZE, a power of
 * two above MM_HDR_MAX) masked with this is always inside the value; the
 * mask is how the verifier is shown that the TLV walk never reads out of
 * bounds.  TLV results live in map memory too (struct mm_tlv_out): values
 * read back from a map are unknown scalars, so the states of different TLV
 * orders merge instead of multiplying. */
#define MM_SCRATCH_MASK (MM_SCRATCH_SIZE - 1)

#endif /* MM_LIB_MAPS_H */
