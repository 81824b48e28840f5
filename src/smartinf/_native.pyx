# cython: language_level=3, binding=False
# distutils: language = c++
"""Binding of the C++ core: translates arguments and errors, releases the GIL. No logic."""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.map cimport map as cmap
from libcpp.memory cimport make_shared, shared_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector


cdef extern from "_native_errors.h":
    cdef void raise_py_error()


cdef extern from "kernels/numeric.h" namespace "smartinf::kernels":
    cdef enum class DType(uint8_t):
        f32
        f16
        bf16


cdef extern from "io/engine.h" namespace "smartinf::io":
    cbool uring_available_at_build()


cdef extern from "io/bandwidth.h" namespace "smartinf::io":
    double time_io(const string&, uint64_t, cbool, const string&, uint64_t,
                   unsigned) except +raise_py_error nogil
    double time_mixed_io(const string&, uint64_t, const string&, uint64_t, unsigned,
                         uint64_t) except +raise_py_error nogil
    double time_adam_kernel(uint64_t, DType, DType, const StateLayout&, unsigned, unsigned) except +raise_py_error nogil
    double time_write_beside_update(const string&, uint64_t, const string&, uint64_t, unsigned,
                                    uint64_t, DType, DType, const StateLayout&,
                                    unsigned) except +raise_py_error nogil
    double time_triad(uint64_t, unsigned) except +raise_py_error nogil


cdef extern from "device/compute_pool.h" namespace "smartinf::device":
    unsigned default_compute_threads_ "smartinf::device::default_compute_threads"() except +raise_py_error
    vector[int] rank_cores_ "smartinf::device::rank_cores"() except +raise_py_error


cdef extern from "device/registry.h" namespace "smartinf::device":
    cdef cppclass DeviceKind:
        const char* name
        bint quantized, split_master, host_budget, storage_cap, phased_io
        const char* options


    const DeviceKind& device_kind_ "smartinf::device::device_kind"(const string&) except +raise_py_error


cdef extern from "store/manifest.h" namespace "smartinf::store":
    cdef cppclass Manifest:
        string serialize()
        @staticmethod
        Manifest parse(const string&, const string&) except +raise_py_error


cdef extern from "store/layout.h" namespace "smartinf::store":
    cdef enum class Moments(uint8_t):
        pass
    const char* kMomentsNames[]
    const unsigned kMomentsCount
    cbool moments_named(const char*, Moments*)

    cdef enum class Master(uint8_t):
        fp32 "smartinf::store::Master::fp32"
        split "smartinf::store::Master::split"

    cdef cppclass StateLayout:
        unsigned arrays
        Moments moments
        Master master
        uint64_t bytes(uint64_t)

    cdef cppclass ChunkLayout:
        uint64_t chunk
        StateLayout layout
        uint64_t copy_bytes(uint64_t)


cdef extern from "store/checksum.h" namespace "smartinf::store":
    uint64_t extent_checksum(const void*, size_t) nogil
    uint64_t c_params_checksum "smartinf::store::params_checksum"(const void*, size_t) nogil


cdef extern from "store/host_pieces.h" namespace "smartinf::store":
    cdef struct HostPart:
        void* dst
        const void* src
        size_t bytes
    cdef struct FiniteCheck:
        unsigned width
        uint32_t magnitude
        uint32_t exponent
    vector[size_t] first_pieces(const vector[HostPart]&, size_t)
    cbool c_walk_pieces "smartinf::store::walk_pieces"(const vector[HostPart]&, size_t, unsigned, const FiniteCheck&, uint64_t*) nogil


cdef extern from "device/registry.h" namespace "smartinf::device":
    uint64_t c_gpu_params_checksum "smartinf::device::gpu_params_checksum"(const void*, size_t) except + nogil
    cdef struct DigestPart:
        pass
    uint64_t c_digest_chunk_units "smartinf::device::digest_chunk_units"()
    void c_queue_gpu_unit_sums "smartinf::device::queue_gpu_unit_sums"(const DigestPart*, size_t, size_t, uint64_t*, int, void*) except + nogil


cdef extern from "fault.h" namespace "smartinf::fault":
    cdef enum class Action(int):
        none
        error
        short_io
        kill
    void arm(const string&, Action, uint64_t, int) except +raise_py_error
    void disarm()


cdef extern from "pipeline/completion.h" namespace "smartinf::pipeline":
    cdef cppclass Completion:
        cbool done()
        void wait() except +raise_py_error nogil


cdef extern from "device/xrt_device.h" namespace "smartinf::device":
    cdef cppclass XrtOptions:
        unsigned index
        string bdf
        string xclbin

    cdef cppclass XrtBandwidth:
        double p2p_read_s, p2p_write_s, to_fpga_s, from_fpga_s
        cbool direct

    XrtBandwidth time_xrt(const XrtOptions&, const string&, uint64_t) except +raise_py_error nogil


cdef extern from "device/device.h" namespace "smartinf::device":
    cdef cppclass CallerParts:
        vector[uint64_t] start
        vector[const void*] grad
        vector[void*] out


cdef extern from "pipeline/pipeline.h" namespace "smartinf::pipeline":
    cdef cppclass DeviceSpec:
        string kind
        string dir
        cmap[string, string] options
        double storage_bps
        string io_schedule
        uint64_t io_burst
        bint twins

    cdef cppclass RingOptions:
        string io
        unsigned queue_depth
        uint64_t piece_bytes

    cdef cppclass PipelineOptions:
        vector[DeviceSpec] devices
        string optimizer
        string state_dtype
        string master
        float initial_state
        uint64_t chunk
        size_t slots
        double host_link_bps
        cbool verify
        string if_exists
        uint64_t memory_budget
        uint64_t commit_every
        cbool commit_waits
        uint32_t copies
        cbool log
        cbool defer_logged_step
        cbool background_commit
        unsigned compute_threads
        RingOptions ring
        string small_dir
        vector[uint64_t] small_numels

    cdef cppclass UpdateHyper:
        double lr, weight_decay, beta1, beta2, eps, momentum, dampening, lr_decay, grad_scale
        cbool nesterov

    cdef cppclass ForeignChunk:
        int64_t subgroup
        uint64_t chunk

    cdef cppclass Gradient:
        const void* data
        DType dtype
        cbool compressed
        const int32_t* index
        uint64_t nnz
        const void* ready
        shared_ptr[CallerParts] parts

    cdef cppclass Pipeline:
        Pipeline(const PipelineOptions&) except +raise_py_error nogil
        size_t add_subgroup(uint64_t, const float*, uint64_t, cbool&, cbool) except +raise_py_error nogil
        shared_ptr[Completion] update(size_t, const Gradient&, void*, DType,
                                      const UpdateHyper&, cbool, cbool) except +raise_py_error nogil
        cbool retractable(size_t) except +raise_py_error nogil
        cbool takes_parts(size_t) except +raise_py_error nogil
        void retract(size_t) except +raise_py_error nogil
        void write_states(size_t, const float* const*, uint64_t) except +raise_py_error nogil
        void read_states(size_t, float* const*, const void*) except +raise_py_error nogil
        vector[ForeignChunk] take_foreign() except +raise_py_error nogil
        unsigned state_arrays()
        void commit() except +raise_py_error nogil
        void seal_logs() except +raise_py_error nogil
        cbool logged_step_pending() except +raise_py_error nogil
        void finish_logged_step() except +raise_py_error nogil
        void drop_logged_step() except +raise_py_error nogil
        void flush() except +raise_py_error nogil
        void settle() except +raise_py_error nogil
        void discard() except +raise_py_error nogil
        vector[size_t] undo_step() except +raise_py_error nogil
        void close() except +raise_py_error nogil
        uint64_t park() except +raise_py_error nogil
        void unpark() except +raise_py_error nogil
        cbool parked()
        cbool closed()
        uint64_t step()
        uint64_t durable_step()
        uint64_t previous_step()
        void roll_back_to(uint64_t) except +raise_py_error nogil
        cbool commit_pending()
        cbool resident(size_t) except +raise_py_error
        size_t subgroup_count()
        uint64_t numel(size_t) except +raise_py_error
        size_t device_of(size_t) except +raise_py_error
        vector[uint64_t] planned_bytes(const vector[uint64_t]&, const vector[cbool]&, uint32_t) except +raise_py_error nogil
        uint64_t subgroup_steps(size_t) except +raise_py_error
        cbool pending()
        cmap[string, double] stats() nogil
        vector[cmap[string, double]] device_stats() nogil
        string engine()
        vector[string] notes()


def walk_pieces(parts, size_t piece, unsigned threads, unsigned width=0,
                uint32_t magnitude=0, uint32_t exponent=0, bint hash=False) -> tuple:
    """Host parts, (dst address or 0, src address, bytes) each, walked piece by piece on
    ``threads`` threads (store/host_pieces.h): copied where dst is given, checked for
    inf/NaN where ``width`` is (2 or 4, with the format's ``magnitude`` and ``exponent``
    masks), hashed where ``hash``. Returns (finite, each part's list of its pieces' XXH3s, or
    None)."""
    cdef vector[HostPart] c_parts
    cdef HostPart part
    for dst, src, nbytes in parts:
        part.dst = <void*><uintptr_t>dst
        part.src = <const void*><uintptr_t>src
        part.bytes = nbytes
        c_parts.push_back(part)
    cdef FiniteCheck check
    check.width, check.magnitude, check.exponent = width, magnitude, exponent
    cdef vector[size_t] first = first_pieces(c_parts, piece)
    cdef vector[uint64_t] sums = vector[uint64_t](first.back() if hash else 0)
    cdef uint64_t* out = sums.data() if hash else <uint64_t*>NULL
    cdef cbool ok
    with nogil:
        ok = c_walk_pieces(c_parts, piece, threads, check, out)
    if not hash:
        return ok, None
    return ok, [[sums[k] for k in range(first[p], first[p + 1])] for p in range(c_parts.size())]


def params_checksum(uintptr_t address, size_t numel, bint gpu=False) -> int:
    """A split master's checksum of ``numel`` bf16 params at address: hashed by the host,
    or (``gpu``) by the current GPU where they lie, as its device hashes them."""
    cdef uint64_t out
    with nogil:
        if gpu:
            out = c_gpu_params_checksum(<const void*>address, numel)
        else:
            out = c_params_checksum(<const void*>address, numel)
    return out


def digest_chunk_units() -> int:
    """The 2-byte units each block of a GPU digest sums (device/cuda_digest.cu)."""
    return c_digest_chunk_units()


def queue_gpu_unit_sums(uintptr_t parts, size_t count, size_t chunks, uintptr_t sums, int gpu,
                        uintptr_t stream) -> None:
    """Queues on ``stream`` of GPU ``gpu`` the keys' unit sums of the ``count`` parts whose
    table (int64, 5 columns: device/registry.h's DigestPart) is at ``parts`` in its memory,
    added into ``sums`` (uint64 pairs, there)."""
    with nogil:
        c_queue_gpu_unit_sums(<const DigestPart*>parts, count, chunks, <uint64_t*>sums, gpu, <void*>stream)


def checksum(uintptr_t address, size_t nbytes) -> int:
    """The extent checksum (XXH3-64, never 0) of nbytes at address."""
    cdef uint64_t h
    with nogil:
        h = extent_checksum(<const void*>address, nbytes)
    return h


def moments_names() -> tuple:
    """The moments formats' names (store/layout.h's list): ``state_dtype``'s values."""
    return tuple(kMomentsNames[i].decode() for i in range(kMomentsCount))


cdef StateLayout adam_layout(str state_dtype, str master):
    cdef StateLayout layout
    layout.arrays = 3
    cdef bytes name = state_dtype.encode()
    if not moments_named(name, &layout.moments):
        raise ValueError(f"state_dtype must be one of {', '.join(moments_names())}, got {state_dtype!r}")
    layout.master = {"fp32": Master.fp32, "split": Master.split}[master]
    return layout


def state_bytes(str state_dtype, str master, uint64_t numel, unsigned arrays=3) -> int:
    """Bytes of one chunk of ``numel`` params' states (store/layout.h), unaligned: Adam's, or
    a rule's of ``arrays`` fp32 arrays (the master first)."""
    cdef StateLayout layout = adam_layout(state_dtype, master)
    layout.arrays = arrays
    return layout.bytes(numel)


def copy_bytes(str state_dtype, str master, uint64_t chunk, uint64_t numel, unsigned arrays=3) -> int:
    """Bytes of one copy of a sub-group of ``numel`` params in ``chunk``-param chunks, each
    4 KiB-aligned (store/layout.h ``ChunkLayout::copy_bytes``)."""
    cdef ChunkLayout chunks
    chunks.chunk = chunk
    chunks.layout = adam_layout(state_dtype, master)
    chunks.layout.arrays = arrays
    return chunks.copy_bytes(numel)


def manifest_roundtrip(bytes text) -> bytes:
    """Parses a manifest (ValueError when it is not a valid one) and serializes it again."""
    return Manifest.parse(text, b"<manifest>").serialize()


_FAULT_ACTIONS = {"error": Action.error, "short": Action.short_io, "kill": Action.kill}


def arm_fault(str point, str action, uint64_t after=0, int errno=5) -> None:
    """Tests only: the (after+1)-th hit of `point` fails with `errno` ("error"), transfers
    half ("short", storage points), or SIGKILLs the process ("kill"). One fault per arm."""
    if action not in _FAULT_ACTIONS:
        raise ValueError(f"action must be one of {sorted(_FAULT_ACTIONS)}, got {action!r}")
    arm(point.encode(), _FAULT_ACTIONS[action], after, errno)


def disarm_fault() -> None:
    disarm()


def io_uring_built() -> bool:
    return uring_available_at_build()


def time_storage(str path, uint64_t nbytes, cbool write, str engine, uint64_t block,
                 unsigned depth) -> float:
    cdef string p = path.encode(), e = engine.encode()
    cdef double seconds
    with nogil:
        seconds = time_io(p, nbytes, write, e, block, depth)
    return seconds


def time_mixed_storage(str path, uint64_t nbytes, str engine, uint64_t block, unsigned depth,
                       uint64_t burst) -> float:
    cdef string p = path.encode(), e = engine.encode()
    cdef double seconds
    with nogil:
        seconds = time_mixed_io(p, nbytes, e, block, depth, burst)
    return seconds


def time_xrt_bandwidth(unsigned index, str bdf, str directory, uint64_t nbytes) -> dict:
    """Seconds to move nbytes SSD <-> FPGA DRAM peer to peer and host <-> FPGA DRAM."""
    cdef XrtOptions o
    cdef string d = directory.encode()
    cdef XrtBandwidth bw
    o.index = index
    o.bdf = bdf.encode()
    with nogil:
        bw = time_xrt(o, d, nbytes)
    return {"p2p_read_s": bw.p2p_read_s, "p2p_write_s": bw.p2p_write_s,
            "to_fpga_s": bw.to_fpga_s, "from_fpga_s": bw.from_fpga_s, "direct": bw.direct}


def time_kernel(uint64_t numel, int grad_dtype, int param_dtype, str state_dtype,
                unsigned threads, str master="fp32", unsigned repeats=3) -> float:
    cdef double seconds
    cdef StateLayout layout = adam_layout(state_dtype, master)
    with nogil:
        seconds = time_adam_kernel(numel, <DType>grad_dtype, <DType>param_dtype, layout, threads, repeats)
    return seconds


def time_storage_beside_update(str path, uint64_t nbytes, str engine, uint64_t block,
                               unsigned depth, uint64_t numel, int grad_dtype, int param_dtype,
                               str state_dtype, unsigned threads, str master="fp32") -> float:
    cdef string p = path.encode(), e = engine.encode()
    cdef StateLayout layout = adam_layout(state_dtype, master)
    cdef double seconds
    with nogil:
        seconds = time_write_beside_update(p, nbytes, e, block, depth, numel, <DType>grad_dtype,
                                           <DType>param_dtype, layout, threads)
    return seconds


def default_compute_threads() -> int:
    return default_compute_threads_()


def device_kind(str kind) -> dict:
    """The registry's row of a device kind (device/registry.h): what a pipeline may ask of
    it; an unknown kind raises ValueError naming the known ones."""
    cdef const DeviceKind* row = &device_kind_(kind.encode())
    return {"name": row.name.decode(), "quantized": row.quantized, "split_master": row.split_master,
            "host_budget": row.host_budget, "storage_cap": row.storage_cap,
            "phased_io": row.phased_io, "options": tuple(row.options.decode().split())}


def rank_cores() -> list:
    """The cores this rank's update threads are pinned to (compute_pool.h); [] for none."""
    return list(rank_cores_())


def triad_seconds(uint64_t nbytes, unsigned threads) -> float:
    cdef double seconds
    with nogil:
        seconds = time_triad(nbytes, threads)
    return seconds


cdef class NativeCompletion:
    cdef shared_ptr[Completion] c

    def done(self) -> bool:
        return self.c.get().done()

    def wait(self) -> None:
        with nogil:
            self.c.get().wait()


def option_text(value) -> str:
    """A device kind's option as the core reads it (device/registry.h's OwnOptions)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


cdef class NativePipeline:
    cdef Pipeline* p

    def __cinit__(self, list devices, str optimizer, float initial_state, settings,
                  str small_dir="", list small_numels=[], cbool defer_logged_step=False):
        """devices: smartinf.devices.NativeDeviceSpec each; settings: a PipelineSettings;
        small_dir, small_numels, defer_logged_step: PipelineOptions'."""
        cdef PipelineOptions options
        cdef DeviceSpec spec
        for d in devices:
            spec.kind = d.kind.encode()
            spec.dir = d.dir.encode()
            spec.options.clear()
            for name, value in d.options.items():
                spec.options[name.encode()] = option_text(value).encode()
            spec.storage_bps = d.storage_bps
            spec.io_schedule = d.io_schedule.encode()
            spec.io_burst = d.io_burst
            spec.twins = d.twins
            options.devices.push_back(spec)
        options.optimizer = optimizer.encode()
        options.initial_state = initial_state
        options.chunk = settings.chunk
        options.slots = settings.slots or 0  # None: the core's auto_slots
        options.host_link_bps = (settings.host_link_gbps or 0.0) * 1e9
        options.verify = settings.verify
        options.state_dtype = settings.state_dtype.encode()
        options.master = settings.master.encode()
        options.if_exists = settings.if_exists.encode()
        options.memory_budget = settings.memory_budget
        options.commit_every = settings.commit_every
        options.commit_waits = settings.commit_waits
        options.copies = 1 if settings.copies == "log" else settings.copies
        options.log = settings.copies == "log"
        options.background_commit = settings.overlap
        options.compute_threads = settings.compute_threads
        options.ring.io = settings.io.encode()
        options.ring.queue_depth = settings.queue_depth
        options.ring.piece_bytes = settings.piece_bytes
        options.small_dir = small_dir.encode()
        options.defer_logged_step = defer_logged_step
        for n in small_numels:
            options.small_numels.push_back(n)
        with nogil:
            self.p = new Pipeline(options)

    def __dealloc__(self):
        if self.p != NULL:
            with nogil:
                del self.p

    def add_subgroup(self, uint64_t numel, uintptr_t init, uint64_t fingerprint, cbool small=False):
        cdef cbool resumed = False
        cdef size_t sg
        with nogil:
            sg = self.p.add_subgroup(numel, <const float*>init, fingerprint, resumed, small)
        return sg, resumed

    def update(self, size_t sg, uintptr_t grad, int grad_dtype, cbool compressed, uintptr_t index,
               uint64_t nnz, uintptr_t out, int out_dtype, dict hyper,
               cbool speculative=False, cbool log_only=False, uintptr_t ready=0,
               list parts=None) -> NativeCompletion:
        """``parts``: (first param, gradient address, params address) of each part of the
        sub-group (takes_parts), ``grad`` and ``out`` then 0."""
        cdef Gradient g
        g.data, g.dtype, g.compressed = <const void*>grad, <DType>grad_dtype, compressed
        g.index, g.nnz, g.ready = <const int32_t*>index, nnz, <const void*>ready
        cdef shared_ptr[CallerParts] held
        if parts is not None:
            held = make_shared[CallerParts]()
            for start, part_grad, part_out in parts:
                held.get().start.push_back(start)
                held.get().grad.push_back(<const void*><uintptr_t>part_grad)
                held.get().out.push_back(<void*><uintptr_t>part_out)
            held.get().start.push_back(self.p.numel(sg))
            g.parts = held
        cdef UpdateHyper h  # kernels::Hyper's defaults; a rule sends the fields it reads
        h.lr, h.weight_decay, h.grad_scale = hyper["lr"], hyper["weight_decay"], hyper["grad_scale"]
        if "beta1" in hyper:
            h.beta1, h.beta2 = hyper["beta1"], hyper["beta2"]
        if "eps" in hyper:
            h.eps = hyper["eps"]
        if "momentum" in hyper:
            h.momentum, h.dampening, h.nesterov = hyper["momentum"], hyper["dampening"], hyper["nesterov"]
        if "lr_decay" in hyper:
            h.lr_decay = hyper["lr_decay"]
        cdef NativeCompletion done = NativeCompletion()
        with nogil:
            done.c = self.p.update(sg, g, <void*>out, <DType>out_dtype, h, speculative, log_only)
        return done

    def takes_parts(self, size_t sg) -> bool:
        cdef cbool r
        with nogil:
            r = self.p.takes_parts(sg)
        return r

    def retractable(self, size_t sg) -> bool:
        cdef cbool r
        with nogil:  # (the pipeline's lock may be held by an update queueing its chunks)
            r = self.p.retractable(sg)
        return r

    def retract(self, size_t sg):
        with nogil:
            self.p.retract(sg)

    def write_states(self, size_t sg, list arrays, uint64_t steps):
        cdef const float* ptrs[4]  # kernels::kMaxStateArrays
        for a in range(4):
            ptrs[a] = <const float*><uintptr_t>(arrays[a] if a < len(arrays) else 0)
        with nogil:
            self.p.write_states(sg, ptrs, steps)

    def read_states(self, size_t sg, list arrays, uintptr_t params=0):
        cdef float* ptrs[4]  # kernels::kMaxStateArrays
        for a in range(4):
            ptrs[a] = <float*><uintptr_t>(arrays[a] if a < len(arrays) else 0)
        with nogil:
            self.p.read_states(sg, ptrs, <const void*>params)

    def take_foreign(self) -> list:
        """(sub-group, chunk) of each chunk whose params came back other than emitted."""
        cdef vector[ForeignChunk] found
        with nogil:
            found = self.p.take_foreign()
        return [(f.subgroup, f.chunk) for f in found]

    def commit(self):
        with nogil:
            self.p.commit()

    def seal_logs(self):
        with nogil:
            self.p.seal_logs()

    def logged_step_pending(self) -> bool:
        cdef cbool r
        with nogil:
            r = self.p.logged_step_pending()
        return r

    def finish_logged_step(self):
        with nogil:
            self.p.finish_logged_step()

    def drop_logged_step(self):
        with nogil:
            self.p.drop_logged_step()

    def flush(self):
        with nogil:
            self.p.flush()

    def settle(self):
        with nogil:
            self.p.settle()

    def discard(self):
        with nogil:
            self.p.discard()

    def undo_step(self) -> list:
        cdef vector[size_t] kept
        with nogil:
            kept = self.p.undo_step()
        return list(kept)

    def close(self):
        with nogil:
            self.p.close()

    def park(self) -> int:
        cdef uint64_t freed
        with nogil:
            freed = self.p.park()
        return freed

    def unpark(self):
        with nogil:
            self.p.unpark()

    @property
    def parked(self) -> bool:
        return self.p.parked()

    @property
    def closed(self) -> bool:
        return self.p.closed()

    @property
    def step(self) -> int:
        return self.p.step()

    @property
    def durable_step(self) -> int:
        return self.p.durable_step()

    @property
    def previous_step(self) -> int:
        return self.p.previous_step()

    def roll_back_to(self, uint64_t step) -> None:
        with nogil:
            self.p.roll_back_to(step)

    @property
    def commit_pending(self) -> bool:
        return self.p.commit_pending()

    def resident(self, size_t sg) -> bool:
        return self.p.resident(sg)

    @property
    def subgroup_count(self) -> int:
        return self.p.subgroup_count()

    @property
    def pending(self) -> bool:
        return self.p.pending()

    def numel(self, size_t sg) -> int:
        return self.p.numel(sg)

    def device_of(self, size_t sg) -> int:
        return self.p.device_of(sg)

    def planned_bytes(self, list numels, list small, uint32_t gradient_bytes=4) -> list:
        """Bytes each device's states file would grow by for these sub-groups, added next
        (with a log, and a step's gradients of ``gradient_bytes`` a param)."""
        cdef vector[uint64_t] n = numels
        cdef vector[cbool] s = small
        cdef vector[uint64_t] grow
        with nogil:
            grow = self.p.planned_bytes(n, s, gradient_bytes)
        return list(grow)

    @property
    def state_arrays(self) -> int:
        return self.p.state_arrays()

    def subgroup_steps(self, size_t sg) -> int:
        return self.p.subgroup_steps(sg)

    def stats(self) -> dict:
        cdef cmap[string, double] found
        with nogil:
            found = self.p.stats()
        return {k.decode(): v for k, v in found}

    def device_stats(self) -> list:
        cdef vector[cmap[string, double]] found
        with nogil:
            found = self.p.device_stats()
        return [{k.decode(): v for k, v in s} for s in found]

    @property
    def engine(self) -> str:
        return self.p.engine().decode()

    def notes(self) -> list:
        return [n.decode() for n in self.p.notes()]
