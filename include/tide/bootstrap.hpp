// bootstrap: the control plane that exchanges window handles between the ranks of a group. Only
// used at set-up time (never on the data path). No external service: a rendezvous directory for
// processes, shared memory of the process for ranks as threads. Python passes handles through a
// torch.distributed Store instead and never needs these.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace tide {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Every rank contributes one string; every rank gets all of them in rank order.
  // Throws TimeoutError naming the missing ranks if they do not all arrive in time.
  virtual std::vector<std::string> allgather(const std::string& mine) = 0;
  void barrier() { allgather({}); }
};

// Ranks as processes (or threads) sharing a directory: round k's contribution of rank r is the file
// <dir>/k.r, published atomically by rename. Files of rounds everyone has read are removed; the
// last round's files stay (a slower peer may still read them): remove the directory when done.
class FileBootstrap final : public Bootstrap {
 public:
  FileBootstrap(std::string dir, int rank, int world, std::chrono::milliseconds timeout);
  ~FileBootstrap() override;
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::vector<std::string> allgather(const std::string& mine) override;

 private:
  std::string path(long round, int rank) const;
  std::string dir_;
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  long round_ = 0;
};

// Ranks as threads of one process: make one ThreadRendezvous, give each thread a ThreadBootstrap.
class ThreadRendezvous;
std::shared_ptr<ThreadRendezvous> make_thread_rendezvous(int world);

class ThreadBootstrap final : public Bootstrap {
 public:
  ThreadBootstrap(std::shared_ptr<ThreadRendezvous> rendezvous, int rank,
                  std::chrono::milliseconds timeout);
  int rank() const override { return rank_; }
  int world() const override;
  std::vector<std::string> allgather(const std::string& mine) override;

 private:
  std::shared_ptr<ThreadRendezvous> rendezvous_;
  int rank_;
  std::chrono::milliseconds timeout_;
  long round_ = 0;
};

// Passes file descriptors between the ranks of `bootstrap` (processes of one machine): every rank
// offers `mine` and receives a duplicate of the descriptor of each rank in `from` (in that order;
// the caller owns and closes them). Unix domain sockets in the abstract namespace with SCM_RIGHTS,
// names exchanged over the bootstrap; no ptrace permission needed. Collective: every rank calls
// it, each with its own `from` (possibly empty). Throws TimeoutError naming the rank that did not
// answer within `timeout`, SystemError for socket failures.
std::vector<int> exchange_fds(Bootstrap& bootstrap, int mine, const std::vector<int>& from,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace tide
