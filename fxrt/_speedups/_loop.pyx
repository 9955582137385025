# distutils: language = c++
# cython: language_level=3, binding=False
"""Python face of the compiled loop (loop.h; py_executor.h builds it from Python objects).

``Executor`` owns one C++ ``fxrt::Executor``. fxrt.exec.native.NativeLoop subclasses it, builds it
instruction by instruction from a Program, and is called directly (the subclass inherits this
type's call slot, so a call costs no Python frame). This module adds no logic of its own beyond
one hand-off to the subclass: a failed run's register file goes to ``_execution_error``, which
builds the exception the Python loop would raise. A call that torch.ops would route through
``__torch_function__`` runs every instruction's Python form (loop.h).
"""

from libc.stdint cimport int64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

from torch._C import _has_torch_function


cdef extern from "python_face.h" namespace "fxrt":
    void set_python_error()

    cdef cppclass Failure:
        int64_t pc

    object failure_registers(Failure& failure)
    const char* built_torch_version()
    int torch_function_state(object inputs) except -1


# fxrt's own CPU ops (fxrt::gelu...), registered with the dispatcher when this module loads.
cdef extern from "own_ops.h":
    pass


cdef extern from "py_executor.h":
    cdef cppclass CExecutor "fxrt::PyExecutor":
        CExecutor(object ref_type, int64_t n_regs, cbool release_gil) except +set_python_error
        void set_inputs(const vector[int64_t]& regs) except +set_python_error
        void set_constant(int64_t reg, object value) except +set_python_error
        void set_output(object tree) except +set_python_error
        void add_free(const vector[int64_t]& regs) except +set_python_error
        string add_call(object plain, cbool multi) except +set_python_error
        string add_out(
            object plain, cbool multi, int64_t slot,
            object out_name, object out_overload, object out_args, object out_kwargs,
            const string& elementwise,
        ) except +set_python_error
        string add_alloc(object plain, int64_t slot, cbool cpu) except +set_python_error
        string add_view(
            object plain, int64_t kind, cbool multi, cbool always,
            const vector[int64_t]& ints, const vector[int64_t]& strides, int64_t offset,
        ) except +set_python_error
        string add_sym(object fn, int64_t kind, object args, int64_t output) except +set_python_error
        string add_kernel(
            object fn, object args, int64_t address, const vector[int64_t]& kinds, int64_t output
        ) except +set_python_error
        void add_pycall(
            object fn, object args, object kwargs, const vector[int64_t]& outputs, cbool multi
        ) except +set_python_error
        void add_stream(int64_t stream) except +set_python_error
        void add_record(int64_t stream, int64_t event) except +set_python_error
        void add_wait(
            int64_t stream, const vector[int64_t]& events, const vector[int64_t]& protect
        ) except +set_python_error
        void set_streams(int64_t n_streams, const string& device, int64_t n_events) except +set_python_error
        void set_arena(object factory, int64_t max_idle, const string& device) except +set_python_error
        void set_guards(
            object specs, object on_mismatch, object arena_inputs, cbool constants_need_grad
        ) except +set_python_error
        void release_arenas()
        size_t idle_arenas()
        object run(object inputs, Failure& failure, cbool through_python)
        object run_timed(
            object inputs, Failure& failure, vector[int64_t]& timings, cbool ranges,
            cbool through_python,
        )
        void set_names(const vector[string]& names) except +set_python_error
        void set_kept_inputs(const vector[int64_t]& positions) except +set_python_error


cdef extern from "replays.h" namespace "fxrt":
    cdef cppclass CReplayIndex "fxrt::ReplayIndex":
        CReplayIndex(object device) except +set_python_error
        int64_t find(object inputs) except +set_python_error
        int64_t add(object inputs) except +set_python_error
        void arm(
            int64_t id, object fixed, object copies, object replay, object leaves, object pool,
            cbool clone, object build,
        ) except +set_python_error
        void disarm(int64_t id) except +set_python_error
        object call(object inputs) except +set_python_error
        int64_t replays(int64_t id) except +set_python_error
        void clear()
        int64_t last_id
        cbool replayed
        int64_t moved
        int why


cdef extern from "<ATen/record_function.h>" namespace "at":
    cbool hasCallbacks()


TORCH_VERSION = built_torch_version().decode()
"""The ``torch.__version__`` this extension was compiled against."""


# Set while an fxrt.profile() block is open (set_instrumenting): calls go to the owner's
# instrumented path.
cdef cbool _instrumenting = False


def set_instrumenting(cbool on):
    """Whether an fxrt.profile() block is open (fxrt.profiler sets it)."""
    global _instrumenting
    _instrumenting = on


cdef inline cbool _through_python(inputs):
    """Whether torch.ops would route this call's ops through ``__torch_function__``."""
    cdef int state = torch_function_state(inputs)
    return state == 1 or (state == 2 and _has_torch_function(inputs))


cdef class Executor:
    """A compiled Program. Subclasses (fxrt.exec.native.NativeLoop) call ``_init_executor`` once,
    add the instructions in program order with the ``add_*`` methods (one per instruction kind;
    each returns None when added, else why it cannot be bound, having added nothing), then call
    the instance with the list of graph inputs. They override ``_execution_error`` to name the
    failing node.
    """

    cdef CExecutor* impl
    cdef public object _owner
    """What a call goes to while a profiler is on (fxrt.profile(), torch.profiler: any
    RecordFunction callback): the CompiledGraph whose loop this is, or None."""

    def __dealloc__(self):
        del self.impl

    def _init_executor(self, ref_type, int64_t n_regs, cbool release_gil):
        """Create the empty C++ executor.

        Args:
            ref_type: the class of register references in instruction arguments (fxrt.ir.Ref).
            n_regs: the size of the register file.
            release_gil: release the GIL while native ops run.
        """
        if self.impl != NULL:
            raise RuntimeError("the executor is already initialised")
        self.impl = new CExecutor(ref_type, n_regs, release_gil)

    cdef CExecutor* _impl(self) except NULL:
        if self.impl == NULL:
            raise RuntimeError("the executor is used before _init_executor")
        return self.impl

    def set_inputs(self, regs):
        self._impl().set_inputs(regs)

    def set_constant(self, int64_t reg, value):
        self._impl().set_constant(reg, value)

    def set_output(self, tree):
        self._impl().set_output(tree)

    def add_free(self, regs):
        self._impl().add_free(regs)

    # CALL, OUT, ALLOC and VIEW take their plain form as one tuple: ``(fn, name, overload, args,
    # kwargs, outputs)``, ``fn`` its Python form, ``name.overload(*args, **kwargs)`` the op.

    def add_call(self, tuple plain, cbool multi):
        """CALL: the plain form."""
        return _why(self._impl().add_call(plain, multi))

    def add_out(
        self, tuple plain, cbool multi, int64_t slot,
        str out_name, str out_overload, tuple out_args, dict out_kwargs, str elementwise="",
    ):
        """OUT: the plain form, and on calls with an arena ``out_name.out_overload(*out_args,
        **out_kwargs)`` writing slot ``slot`` (``multi``: output k writes slot ``slot + k``; the
        written arguments read the result registers), or its inline ``elementwise`` form when
        the tensors allow (elementwise.h)."""
        return _why(self._impl().add_out(
            plain, multi, slot, out_name, out_overload, out_args, out_kwargs,
            elementwise.encode(),
        ))

    def add_alloc(self, tuple plain, int64_t slot, cbool cpu):
        """ALLOC: arena slot ``slot`` (-1: none), else the direct CPU empty_strided (``cpu``),
        else the plain form."""
        return _why(self._impl().add_alloc(plain, slot, cpu))

    def add_view(
        self, tuple plain, int64_t kind, cbool multi, cbool always, ints, strides, int64_t offset
    ):
        """VIEW of kind ``kind`` (0 view, 1 t, 2 transpose, 3 permute, 4 reinterpret, 5 split:
        ``multi``, one output per piece), made inline on every call (``always``) or on calls with
        an arena; else the plain form."""
        return _why(self._impl().add_view(plain, kind, multi, always, ints, strides, offset))

    def add_sym(self, fn, int64_t kind, tuple args, int64_t output):
        """SYM step ``kind`` (0 add ... 13 min, loop.h's order) on registers and ints."""
        return _why(self._impl().add_sym(fn, kind, args, output))

    def add_kernel(self, fn, tuple args, int64_t address, kinds, int64_t output):
        """KERNEL: the C function at ``address`` on ``args`` (registers and ints), ``kinds``
        0 for a pointer parameter and 1 for an integer one; ``fn(*args)`` its Python form."""
        return _why(self._impl().add_kernel(fn, args, address, kinds, output))

    def add_pycall(self, fn, tuple args, dict kwargs, outputs, cbool multi):
        """PYCALL ``fn(*args, **kwargs)``."""
        self._impl().add_pycall(fn, args, kwargs, outputs, multi)

    def add_stream(self, int64_t stream):
        """STREAM: what follows runs on stream ``stream``."""
        self._impl().add_stream(stream)

    def add_record(self, int64_t stream, int64_t event):
        """RECORD event ``event`` on stream ``stream``."""
        self._impl().add_record(stream, event)

    def add_wait(self, int64_t stream, events, protect):
        """WAIT on stream ``stream`` for ``events``; ``protect``: registers whose memory the
        stream uses from then on (a device's record_stream)."""
        self._impl().add_wait(stream, events, protect)

    def set_streams(self, int64_t n_streams, str device, int64_t n_events):
        """A multi-stream program (after every instruction was added): ``n_streams`` streams on
        device type ``device`` (``"cpu"``: worker threads), ``n_events`` events per call."""
        self._impl().set_streams(n_streams, device.encode(), n_events)

    def set_arena(self, factory, int64_t max_idle=2, str device="cpu"):
        """Use an arena on ``device``: ``factory()`` makes one (a list of tensors, one per
        slot); at most ``max_idle`` arenas per inference mode and current stream are kept
        between calls."""
        self._impl().set_arena(factory, max_idle, device.encode())

    def set_guards(self, list specs, on_mismatch, list arena_inputs, cbool constants_need_grad):
        """The Program's per-call guards (fxrt.exec.guards): input ``specs`` as ``(position,
        meta tensor of the dtype, device, sizes, strides)`` with ``on_mismatch(inputs)`` returning
        the exception a mismatch raises; ``arena_inputs`` as ``(position, meta tensor)`` pairs an
        input must match in size and dtype to use the arena; with ``constants_need_grad``, calls
        in grad mode run without the arena."""
        self._impl().set_guards(specs, on_mismatch, arena_inputs, constants_need_grad)

    def release_arenas(self):
        """Free the arenas kept between calls."""
        self._impl().release_arenas()

    def idle_arenas(self):
        """How many arenas are kept between calls now."""
        return self._impl().idle_arenas()

    def set_names(self, names):
        """Node names per instruction (program order), for torch.profiler ranges."""
        self._impl().set_names([n.encode() for n in names])

    def run_timed(self, inputs, cbool ranges=False):
        """Run once through the instrumented loop; return ``(output, timings)`` where timings is
        a flat list of ``pc, start_ns, end_ns`` for every instruction but FREEs."""
        cdef Failure failure
        cdef vector[int64_t] timings
        cdef CExecutor* impl = self._impl()
        try:
            out = impl.run_timed(inputs, failure, timings, ranges, _through_python(inputs))
        except Exception as exc:
            if failure.pc < 0:
                raise
            regs = failure_registers(failure)
            raise self._execution_error(failure.pc, regs, exc) from exc
        return out, timings

    def _execution_error(self, pc, regs, exc):
        """The exception to raise, from ``exc``, when instruction ``pc`` failed; ``regs`` is the
        register file at that point."""
        return exc

    def __call__(self, *args):
        """Run on the graph inputs: one list or tuple (boxed, as Dynamo and AOTAutograd call
        it; a graph input is never a list or tuple) or each as an argument. While a profiler is
        on, the owner (a CompiledGraph) runs the call, instrumented."""
        inputs = args[0] if len(args) == 1 and type(args[0]) in (list, tuple) else args
        if (_instrumenting or hasCallbacks()) and self._owner is not None:
            return self._owner(inputs if type(inputs) is list else list(inputs))
        return self._run(inputs)

    def run(self, inputs):
        """Run on ``inputs`` (a list or tuple of the graph inputs), never instrumented."""
        return self._run(inputs)

    cdef object _run(self, inputs):
        cdef Failure failure
        cdef CExecutor* impl = self._impl()
        try:
            return impl.run(inputs, failure, _through_python(inputs))
        except Exception as exc:
            if failure.pc < 0:
                raise
            regs = failure_registers(failure)
            raise self._execution_error(failure.pc, regs, exc) from exc

    def set_kept_inputs(self, positions):
        """The static inputs (parameters, buffers) by position: a frame keeps their tensors
        between calls (frames.h). Before the first call."""
        self._impl().set_kept_inputs(positions)


cdef _why(string why):
    return why.decode() if why.size() else None


cdef class ReplayIndex:
    """Whole-graph capture's per-call work in C++ (replays.h); fxrt.exec.replays.ReplayIndex is
    its Python twin and documents the methods."""

    cdef CReplayIndex* impl

    def __cinit__(self, device):
        self.impl = new CReplayIndex(device)

    def __dealloc__(self):
        del self.impl

    def find(self, inputs):
        return self.impl.find(inputs)

    def add(self, inputs):
        return self.impl.add(inputs)

    def arm(self, int64_t id, fixed, copies, replay, leaves, pool, cbool clone, build):
        self.impl.arm(id, fixed, copies, replay, leaves, pool, clone, build)

    def disarm(self, int64_t id):
        self.impl.disarm(id)

    def call(self, inputs):
        return self.impl.call(inputs)

    def replays(self, int64_t id):
        return self.impl.replays(id)

    def clear(self):
        self.impl.clear()

    @property
    def last_id(self):
        return self.impl.last_id

    @property
    def replayed(self):
        return self.impl.replayed

    @property
    def moved(self):
        return self.impl.moved

    @property
    def why(self):
        return _WHY[self.impl.why]


_WHY = ("", "changed address", "changed storage size")
