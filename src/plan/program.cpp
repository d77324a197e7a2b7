// Names and the readable listing of programs.
#include <sstream>

#include "tide/plan.hpp"

namespace tide {

const char* collective_name(Collective collective) {
  return collective == Collective::kAllGather ? "all_gather" : "reduce_scatter";
}

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kCastIn: return "cast_in";
    case Phase::kSlotFree: return "slot_free";
    case Phase::kPush: return "push";
    case Phase::kDataReady: return "data_ready";
    case Phase::kReduce: return "reduce";
  }
  return "invalid";
}

static const char* flag_name(FlagKind kind) {
  return kind == FlagKind::kSlotFree ? "slot_free" : "data_ready";
}

static std::ostream& operator<<(std::ostream& os, const Address& a) {
  const char* space = a.space == Space::kWindow ? "win" : a.space == Space::kInput ? "in" : "out";
  return os << space << '[' << a.index << "]+" << a.offset;
}

std::size_t Program::bytes_pushed() const {
  std::size_t total = 0;
  for (const Step& step : steps)
    if (const auto* batch = std::get_if<CopyBatch>(&step.op))
      for (const CopyOp& c : batch->copies) total += c.total_bytes();
  return total;
}

std::string Program::to_string() const {
  std::ostringstream os;
  os << "program " << collective_name(collective) << " rank " << rank << "/" << world
     << " bucket " << bucket << ": " << num_params << " params, window " << window_bytes
     << " B, " << steps.size() << " steps, " << bytes_pushed() << " B pushed, delivery "
     << delivery_name(delivery) << "\n";
  for (const Step& step : steps) {
    os << "  [" << phase_name(step.phase) << "] ";
    std::visit(
        [&](const auto& op) {
          using T = std::decay_t<decltype(op)>;
          if constexpr (std::is_same_v<T, CopyBatch>) {
            std::size_t bytes = 0;
            for (const CopyOp& c : op.copies) bytes += c.total_bytes();
            os << "copy batch: " << op.copies.size() << " copies, " << bytes << " B\n";
            for (const CopyOp& c : op.copies) {
              os << "      " << c.src << " -> " << c.dst << " (" << c.bytes << " B";
              if (c.rows > 1)
                os << " x " << c.rows << " rows, pitch " << c.src_pitch << " -> " << c.dst_pitch;
              os << ")\n";
            }
          } else if constexpr (std::is_same_v<T, CastOp>) {
            os << "cast " << op.src << " -> " << op.dst << " (" << dtype_name(op.src_dtype)
               << "->" << dtype_name(op.dst_dtype) << ", " << op.count << " elems + " << op.pad
               << " zero pad";
            if (op.rows > 1) os << " x " << op.rows << " rows, dst pitch " << op.dst_pitch;
            os << ")\n";
          } else if constexpr (std::is_same_v<T, SignalOp>) {
            os << "signal " << flag_name(op.kind) << " -> rank " << op.peer << "\n";
          } else if constexpr (std::is_same_v<T, WaitOp>) {
            os << "wait " << flag_name(op.kind) << " <- rank " << op.peer << "\n";
          } else if constexpr (std::is_same_v<T, NetSendOp>) {
            os << "net send " << op.src << " -> rank " << op.peer << " (" << op.bytes
               << " B, channel " << op.channel << ")\n";
          } else if constexpr (std::is_same_v<T, NetRecvOp>) {
            os << "net recv " << op.dst << " <- rank " << op.peer << " (" << op.bytes
               << " B, channel " << op.channel << ")\n";
          } else {
            os << "reduce param " << op.param << ": " << op.count << " elems ("
               << dtype_name(op.src_dtype) << "->" << dtype_name(op.dst_dtype) << "), "
               << op.sources.size() << " sources in rank order, x" << op.prescale << " then x"
               << op.scale << (op.accumulate ? ", += into " : ", into ") << op.dst << "\n";
            os << "      sources:";
            for (const Address& a : op.sources) os << ' ' << a;
            if (op.partial) os << "\n      onto the " << dtype_name(op.partial_dtype) << " partial " << *op.partial;
            os << "\n";
          }
        },
        step.op);
  }
  return os.str();
}

}  // namespace tide
