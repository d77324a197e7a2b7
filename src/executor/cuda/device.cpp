// cuda_device_available(): answers without initialising CUDA in this process when it can, so the
// process may still fork() ranks that use CUDA (a child of a process that initialised CUDA cannot
// use it).
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>

#include "tide/cuda.hpp"

namespace tide {
namespace {

bool ask_in_process() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  (void)cudaGetLastError();
  return ok;
}

// A child asks and answers with its exit status; a child that does not answer within 60 s (a
// wedged driver) is killed and counts as "no device".
bool ask_in_child() {
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) ::_exit(ask_in_process() ? 0 : 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    int status = 0;
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (done < 0) return false;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

bool cuda_device_available() {
  static std::once_flag once;
  static bool available = false;
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
        available = false;
        return;
      }
      available = ask_in_child();
    });
  } catch (...) {
    available = false;
  }
  return available;
}

}  // namespace tide
