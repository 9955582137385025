# distutils: language = c++
# cython: language_level=3, binding=False
"""Python face of the compiled loop (loop.h).

``Executor`` owns one C++ ``fxrt::Executor``. fxrt.exec.native.NativeLoop subclasses it, builds it
instruction by instruction from a Program, and is called directly (the subclass inherits this
type's call slot, so a call costs no Python frame). This module adds no logic of its own beyond
two hand-offs to the subclass: a failed run's register file goes to ``_execution_error``, which
builds the exception the Python loop would raise, and a call that torch.ops would route through
``__torch_function__`` goes to ``_run_with_torch_function``.
"""

from libc.stdint cimport int64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

from torch._C import _has_torch_function


cdef extern from "loop.h" namespace "fxrt":
    void set_python_error()

    cdef cppclass Failure:
        int64_t pc

    object failure_registers(Failure& failure)
    const char* built_torch_version()
    int torch_function_state(object inputs) except -1


# fxrt's own CPU ops (fxrt::gelu...), registered with the dispatcher when this module loads.
cdef extern from "kernels.h":
    pass


cdef extern from "loop.h":
    cdef cppclass CExecutor "fxrt::Executor":
        CExecutor(object ref_type, int64_t n_regs, cbool release_gil) except +set_python_error
        void set_inputs(const vector[int64_t]& regs) except +set_python_error
        void set_constant(int64_t reg, object value) except +set_python_error
        void set_output(object tree) except +set_python_error
        void add_free(const vector[int64_t]& regs) except +set_python_error
        cbool add_call(
            object name,
            object overload,
            object args,
            object kwargs,
            const vector[int64_t]& outputs,
            cbool multi,
        ) except +set_python_error
        cbool set_arena_slot(
            int64_t slot, object out_name, object out_overload, object out_args, object out_kwargs
        ) except +set_python_error
        void set_arena(object factory, object guards, cbool constants_need_grad, int64_t max_idle) except +set_python_error
        void release_arenas()
        size_t idle_arenas()
        void set_input_specs(object specs, object on_mismatch) except +set_python_error
        cbool set_inline_view() except +set_python_error
        void add_pycall(
            object fn, object args, object kwargs, const vector[int64_t]& outputs, cbool multi
        ) except +set_python_error
        object run(object inputs, Failure& failure)
        object run_timed(object inputs, Failure& failure, vector[int64_t]& timings, cbool ranges)
        void set_names(const vector[string]& names) except +set_python_error


TORCH_VERSION = built_torch_version().decode()
"""The ``torch.__version__`` this extension was compiled against."""


cdef class Executor:
    """A compiled Program. Subclasses (fxrt.exec.native.NativeLoop) call ``_init_executor`` once,
    add the instructions in program order with the ``add_*`` methods, then call the instance
    with the list of graph inputs. They override ``_execution_error`` to name the failing node.
    """

    cdef CExecutor* impl

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

    def add_call(self, str name, str overload, tuple args, dict kwargs, outputs, cbool multi):
        """Add an ATen call; False (nothing added) if it cannot run natively."""
        return self._impl().add_call(name, overload, args, kwargs, outputs, multi)

    def set_arena_slot(self, int64_t slot, out_name, out_overload, tuple out_args, out_kwargs):
        """Give the call just added arena slot ``slot``, written by the ATen call
        ``out_name.out_overload(*out_args, **out_kwargs)`` whose ``out`` reads the result's
        register (``out_name`` None: an allocation, no call). False if it cannot be bound."""
        return self._impl().set_arena_slot(slot, out_name, out_overload, out_args, out_kwargs)

    def set_inline_view(self):
        """Let the call just added be made inline as a view on calls that use the arena (no
        autograd); False if it cannot be."""
        return self._impl().set_inline_view()

    def set_arena(self, factory, list guards, cbool constants_need_grad, int64_t max_idle=2):
        """Use an arena: ``factory()`` makes one (a list of tensors, one per slot); ``guards``
        lists ``(input position, meta tensor)`` pairs the inputs must match in size and dtype;
        with ``constants_need_grad``, calls in grad mode run without the arena; at most
        ``max_idle`` arenas per inference mode are kept between calls."""
        self._impl().set_arena(factory, guards, constants_need_grad, max_idle)

    def release_arenas(self):
        """Free the arenas kept between calls."""
        self._impl().release_arenas()

    def idle_arenas(self):
        """How many arenas are kept between calls now."""
        return self._impl().idle_arenas()

    def set_input_specs(self, list specs, on_mismatch):
        """Check every call's inputs: ``specs`` are ``(position, meta tensor of the dtype,
        device, sizes, strides)`` (fxrt.exec.inputs); ``on_mismatch(inputs)`` returns the
        exception a mismatch raises."""
        self._impl().set_input_specs(specs, on_mismatch)

    def add_pycall(self, fn, tuple args, dict kwargs, outputs, cbool multi):
        """Add a call of a Python callable."""
        self._impl().add_pycall(fn, args, kwargs, outputs, multi)

    def set_names(self, names):
        """Node names per instruction (program order), for torch.profiler ranges."""
        self._impl().set_names([n.encode() for n in names])

    def run_timed(self, inputs, cbool ranges=False):
        """Run once through the instrumented loop; return ``(output, timings)`` where timings is
        a flat list of ``pc, start_ns, end_ns`` for every CALL and PYCALL."""
        cdef Failure failure
        cdef vector[int64_t] timings
        cdef CExecutor* impl = self._impl()
        try:
            out = impl.run_timed(inputs, failure, timings, ranges)
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

    def _run_with_torch_function(self, inputs):
        """Run a call whose ops torch.ops would send through ``__torch_function__`` (an active
        TorchFunctionMode, a tensor subclass input): the compiled loop cannot, subclasses can."""
        raise NotImplementedError("__torch_function__ is active; run this call on the Python loop")

    def __call__(self, inputs):
        cdef Failure failure
        cdef CExecutor* impl = self._impl()
        cdef int state = torch_function_state(inputs)
        if state == 1 or (state == 2 and _has_torch_function(inputs)):
            return self._run_with_torch_function(inputs)
        try:
            return impl.run(inputs, failure)
        except Exception as exc:
            if failure.pc < 0:
                raise
            regs = failure_registers(failure)
            raise self._execution_error(failure.pc, regs, exc) from exc
