// One file system's I/O turns across the processes of a host (the ranks of one machine
// whose directories share a drive). A device's phased schedule (IoPhases) takes turns of
// one direction between its own reads and write-backs; without this, several processes'
// turns would still mix on the drive. With it, a process starts a turn's requests only
// while it holds the file system's turn: an exclusive flock(2) of a file named by the file
// system's device number in /dev/shm (else the temp directory), which every process of the
// host opens for that drive, and which the kernel releases when its holder dies (a killed
// rank never holds the others up). flock grants no order: a turn's holder yields before it
// asks again, and since every rank's step reads and writes its own states, the drive's
// bytes a step are the same in any order.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

namespace smartinf::pipeline {

class HostTurns {
 public:
  // Whether phased rings take the drive's turns across the host (SMARTINF_IO_TURNS: "host",
  // the default, or "process": each process's rings alone; anything else is refused).
  static bool across_host();

  // The turns of the file system holding `directory`; `waits` counts the takes that had to
  // wait for another holder.
  HostTurns(const std::string& directory, std::atomic<uint64_t>& waits);
  ~HostTurns();
  HostTurns(const HostTurns&) = delete;
  HostTurns& operator=(const HostTurns&) = delete;

  // Takes the turn: at once if free (true), else false (try_take) or once the holder
  // gives it back (take).
  bool try_take();
  void take();
  void give_back();

 private:
  std::string path_;
  int fd_ = -1;
  std::atomic<uint64_t>& waits_;
};

}  // namespace smartinf::pipeline
