// A program's tag as executors carry it in flags and network posts: Program::tag() (bucket << 1 |
// collective), widened to 64 bits. Its top bit is the host executor's "withdrawn" marker
// (kAbandonedTag): a slot-free signal whose collective failed on its sender; Program::tag() never
// sets it. One place for naming tags and flag kinds in messages, so both executors say the same.
#pragma once

#include <cstdint>
#include <string>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide::detail {

inline constexpr uint64_t kAbandonedTag = uint64_t{1} << 63;

inline uint64_t encode_tag(uint32_t bucket, Collective collective) {
  return (uint64_t{bucket} << 1) | static_cast<uint64_t>(collective);
}
inline uint32_t tag_bucket(uint64_t tag) { return static_cast<uint32_t>((tag & ~kAbandonedTag) >> 1); }
inline Collective tag_collective(uint64_t tag) { return static_cast<Collective>(tag & 1); }

// "bucket 3 reduce_scatter"
inline std::string describe_tag(uint64_t tag) {
  return concat("bucket ", tag_bucket(tag), " ", collective_name(tag_collective(tag)));
}

// Appended after "<tag> at epoch <e>" for a signal whose collective failed on its sender.
inline const char* withdrawn(uint64_t tag) {
  return (tag & kAbandonedTag) ? " (since withdrawn: that collective failed there)" : "";
}

inline const char* flag_kind_name(FlagKind kind) {
  return kind == FlagKind::kSlotFree ? "slot_free" : "data_ready";
}

}  // namespace tide::detail
