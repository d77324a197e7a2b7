// NcclLibrary: NCCL is loaded at run time and checked before use. Each case runs in a fresh child
// process (the library is loaded once per process). Without NCCL (CI) the error names every place
// looked; a TIDE_NCCL_LIB that is not NCCL is refused by name; where NCCL exists, its version is
// at least the minimum and every entry point TIDE uses resolved.
#include <gtest/gtest.h>

#include <cstdlib>

#include "rank_runner.hpp"
#include "tide/error.hpp"
#include "tide/nccl.hpp"

namespace tide {
namespace {

std::string load_in_child(const char* env_path) {
  const harness::RankProcesses run = harness::run_rank_processes(1, [&](int, Bootstrap&) {
    if (env_path) ::setenv("TIDE_NCCL_LIB", env_path, 1);
    const NcclLibrary& nccl = NcclLibrary::get();
    return "loaded " + nccl.version_string() + " from " + nccl.path();
  });
  return run.reports[0];
}

TEST(NcclLoader, MissingLibraryIsAClearError) {
  const std::string report = load_in_child("/nonexistent/libnccl.so.2");
  EXPECT_EQ(report.rfind("Error: NCCL not found", 0), 0u) << report;
  EXPECT_NE(report.find("/nonexistent/libnccl.so.2"), std::string::npos) << report;
  EXPECT_NE(report.find("TIDE_NCCL_LIB"), std::string::npos) << report;
}

TEST(NcclLoader, ALibraryThatIsNotNcclIsRefused) {
  const std::string report = load_in_child("libm.so.6");  // loads, but has no ncclGetVersion
  EXPECT_EQ(report.rfind("Error: ", 0), 0u) << report;
  EXPECT_NE(report.find("libm.so.6 has no ncclGetVersion"), std::string::npos) << report;
}

TEST(NcclLoader, DefaultSearchLoadsARecentNcclOrSaysWhereItLooked) {
  const std::string report = load_in_child(nullptr);
  if (report.rfind("loaded ", 0) == 0) {
    const std::string version = report.substr(7, report.find(' ', 7) - 7);
    EXPECT_GE(std::stoi(version.substr(0, version.find('.'))), 2) << report;
    SUCCEED() << report;
  } else {
    EXPECT_NE(report.find("NCCL not found"), std::string::npos) << report;
    EXPECT_NE(report.find("libnccl.so.2"), std::string::npos) << report;
  }
}

}  // namespace
}  // namespace tide
