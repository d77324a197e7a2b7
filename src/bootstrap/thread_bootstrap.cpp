#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>

#include "tide/bootstrap.hpp"
#include "tide/error.hpp"

namespace tide {

class ThreadRendezvous {
 public:
  explicit ThreadRendezvous(int world) : world_(world) {}
  int world() const { return world_; }

  std::vector<std::string> exchange(long round, int rank, const std::string& mine,
                                    std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    Round& r = rounds_[round];
    if (r.values.empty()) r.values.resize(world_), r.present.resize(world_, false);
    r.values[rank] = mine;
    r.present[rank] = true;
    ++r.arrived;
    cv_.notify_all();
    if (!cv_.wait_for(lock, timeout, [&] { return r.arrived == world_; })) {
      std::ostringstream absent;
      for (int k = 0; k < world_; ++k)
        if (!r.present[k]) absent << ' ' << k;
      throw TimeoutError(detail::concat("ThreadBootstrap: rank ", rank, " waited ", timeout.count(),
                                        " ms in round ", round, " for rank(s)", absent.str()));
    }
    std::vector<std::string> out = r.values;
    if (++r.departed == world_) rounds_.erase(round);
    return out;
  }

 private:
  struct Round {
    std::vector<std::string> values;
    std::vector<bool> present;
    int arrived = 0;
    int departed = 0;
  };
  int world_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<long, Round> rounds_;
};

std::shared_ptr<ThreadRendezvous> make_thread_rendezvous(int world) {
  TIDE_CHECK_ARG(world >= 1, "make_thread_rendezvous", "world", world, ">= 1");
  return std::make_shared<ThreadRendezvous>(world);
}

ThreadBootstrap::ThreadBootstrap(std::shared_ptr<ThreadRendezvous> rendezvous, int rank,
                                 std::chrono::milliseconds timeout)
    : rendezvous_(std::move(rendezvous)), rank_(rank), timeout_(timeout) {
  TIDE_CHECK_ARG(rendezvous_ != nullptr, "ThreadBootstrap", "rendezvous", "null", "non-null");
  TIDE_CHECK_ARG(rank >= 0 && rank < rendezvous_->world(), "ThreadBootstrap", "rank", rank,
                 detail::concat("in [0, ", rendezvous_->world(), ")"));
  TIDE_CHECK_ARG(timeout.count() > 0, "ThreadBootstrap", "timeout_ms", timeout.count(), "> 0");
}

int ThreadBootstrap::world() const { return rendezvous_->world(); }

std::vector<std::string> ThreadBootstrap::allgather(const std::string& mine) {
  return rendezvous_->exchange(round_++, rank_, mine, timeout_);
}

}  // namespace tide
