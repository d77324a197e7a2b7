// cuda_device_count(): answers without initialising CUDA in this process when it can, so the
// process may still fork() ranks that use CUDA (a child of a process that initialised CUDA cannot
// use it).
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>

#include "tide/cuda.hpp"

namespace tide {
namespace {

int ask_in_process() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  (void)cudaGetLastError();
  return count;
}

// A child asks and answers with its exit status (the count, up to 255); a child that does not
// answer within 60 s (a wedged driver) is killed and counts as "no device".
int ask_in_child() {
  const pid_t pid = ::fork();
  if (pid < 0) return 0;
  if (pid == 0) ::_exit(std::min(ask_in_process(), 255));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    int status = 0;
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
    if (done < 0) return 0;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

int cuda_device_count() {
  static std::once_flag once;
  static int available = 0;
  try {
    std::call_once(once, [] {
      // Something in this process already loaded the driver (PyTorch, an earlier CudaWindow):
      // fork-safety is already lost, and a child could not use CUDA anyway, so ask here.
      if (void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
        ::dlclose(driver);
        available = ask_in_process();
        return;
      }
      // No NVIDIA control device: no driver, no GPU (cheap, and avoids forking for nothing).
      if (::access("/dev/nvidiactl", F_OK) != 0) {
        available = 0;
        return;
      }
      available = ask_in_child();
    });
  } catch (...) {
    available = 0;
  }
  return available;
}

bool cuda_device_available() { return cuda_device_count() > 0; }

}  // namespace tide
