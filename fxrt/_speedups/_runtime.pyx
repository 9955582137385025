# distutils: language = c++
# cython: language_level=3, binding=False
"""Python face of fxrt's C++ runtime (csrc/: the package loader, binder, input checks and weights
that the C++ API ships, compiled into this module): ``Model`` loads a package and runs it.

fxrt.deploy.loaded builds LoadedModel on it. A call made as the package was exported (positional
leaves only, no profiler or ``__torch_function__`` to honour) goes from ``Model.__call__`` to the
runtime with no Python frame; any other goes to the subclass's ``_call(args, kwargs)``.
"""

from libc.stdint cimport int64_t
from libcpp cimport bool as cbool
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string


cdef extern from "runtime_face.h" namespace "fxrt":
    void raise_runtime_error()
    void set_face_errors(object package, object unsupported, object input, object run)

    cdef cppclass CRuntimeModel "fxrt::Model":
        size_t num_outputs()
        const string& module_name()
        size_t num_instructions()
        size_t mapped_weights()
        size_t idle_arenas()
        const string& unsupported()

    cdef cppclass CFaceModel "fxrt::FaceModel":
        CFaceModel(
            object source, const string& device, cbool verify, cbool arena, int64_t max_idle,
            int check_inputs, cbool host_executor
        ) except +raise_runtime_error
        object run(object args) except +raise_runtime_error
        object run_on(object args, object executor) except +raise_runtime_error
        object entry_bytes(const string& name) except +raise_runtime_error
        object state_dict() except +raise_runtime_error
        void update_weights(object weights, cbool strict) except +raise_runtime_error
        object inputs() except +raise_runtime_error
        object manifest_json() except +raise_runtime_error
        object manifest_field(const string& key) except +raise_runtime_error
        const CRuntimeModel& model()


from torch._C import _has_torch_function


def set_errors(package, unsupported, input, run):
    """The Python exceptions the runtime's errors become: PackageError, the error of a valid
    package the runtime cannot run, InputError, and ``run(message, cause)`` building the
    exception of a failed op (cause: fxrt::RunError::Cause)."""
    set_face_errors(package, unsupported, input, run)


cdef class Model:
    """One package loaded by the C++ runtime: ``Model(path_or_bytes, device, verify_weights,
    arena=True, arena_max_idle=-1, check_inputs=-1, host_executor=False)`` (-1: the package's
    option); with ``host_executor``, a package the runtime cannot run loads and runs only through
    :meth:`run_on` (``unsupported`` says why)."""

    cdef unique_ptr[CFaceModel] _m
    cdef Py_ssize_t _direct_args
    cdef object _direct_executor

    def __init__(
        self,
        source,
        device,
        cbool verify_weights,
        cbool arena=True,
        int64_t arena_max_idle=-1,
        int check_inputs=-1,
        cbool host_executor=False,
    ):
        self._m.reset(
            new CFaceModel(
                source,
                (device or "").encode(),
                verify_weights,
                arena,
                arena_max_idle,
                check_inputs,
                host_executor,
            )
        )
        self._direct_args = -1

    def _set_direct(self, Py_ssize_t n_args, executor=None):
        """Calls of ``n_args`` positional arguments with one output go to the runtime directly
        (with ``executor``, to :meth:`run_on` with it)."""
        self._direct_args = n_args
        self._direct_executor = executor

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != self._direct_args or _hooks_on(args):
            return self._call(args, kwargs)
        if self._direct_executor is not None:
            return self._m.get().run_on(args, self._direct_executor)[0]
        return self._m.get().run(args)[0]

    def _call(self, args, kwargs):
        raise NotImplementedError

    def run(self, leaves):
        """The outputs (a list) of a call on the user inputs in call order (constants left
        out), as the C++ API's ``Model::run``."""
        return self._m.get().run(leaves)

    def run_on(self, leaves, executor):
        """As :meth:`run`, the graph run by ``executor(graph_inputs) -> graph_outputs`` (the
        inputs checked, the weights of one set and the mutations copied back by the runtime)."""
        return self._m.get().run_on(leaves, executor)

    @property
    def unsupported(self):
        """Why the runtime cannot run the package itself ("": it can)."""
        return self._m.get().model().unsupported().decode()

    def _entry_bytes(self, str name):
        """The bytes of one weights-section entry ("graph/<name>"; empty: none)."""
        return self._m.get().entry_bytes(name.encode())

    def state_dict(self):
        """The current weights by name (tied names map to one tensor)."""
        return self._m.get().state_dict()

    def _update_weights(self, weights, cbool strict):
        self._m.get().update_weights(weights, strict)

    @property
    def inputs(self):
        """The user inputs in call order: ``(name, path, is_int)`` each."""
        return self._m.get().inputs()

    def _manifest_json(self):
        """The package's manifest, as its JSON bytes."""
        return self._m.get().manifest_json()

    def _manifest_field(self, str key):
        """One top-level field of the manifest as JSON bytes (empty: none, or written with
        escapes)."""
        return self._m.get().manifest_field(key.encode())

    @property
    def module_name(self):
        return self._m.get().model().module_name().decode()

    @property
    def num_outputs(self):
        return self._m.get().model().num_outputs()

    @property
    def num_instructions(self):
        return self._m.get().model().num_instructions()

    @property
    def idle_arenas(self):
        """How many arenas are kept idle between calls now."""
        return self._m.get().model().idle_arenas()

    @property
    def mapped_weights(self):
        return self._m.get().model().mapped_weights()


# Set by fxrt.profiler while a profile is open; the runtime has no per-op timings of its own.
cdef cbool _instrumenting = False


def set_instrumenting(cbool on):
    global _instrumenting
    _instrumenting = on


cdef extern from "<ATen/record_function.h>" namespace "at":
    cbool hasCallbacks()


cdef extern from "torch_function.h" namespace "fxrt":
    int torch_function_state(object inputs) except -1


def hooks_on(args):
    """Whether a call on ``args`` must take the Python loop (see ``_hooks_on``)."""
    return bool(_hooks_on(args))


cdef inline int _hooks_on(args) except -1:
    """Whether a call must take the Python path: a profiler, record_function callbacks, or a
    ``__torch_function__`` (a mode, or a tensor subclass that overrides it)."""
    if _instrumenting or hasCallbacks():
        return True
    cdef int tf = torch_function_state(args)
    return tf == 1 or (tf == 2 and _has_torch_function(args))
