#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include "internal/pycore_runtime.h"
#include "internal/pycore_interp.h"
#if PY_VERSION_HEX >= 0x030B0000
#include "internal/pycore_frame.h"
#else
#include <frameobject.h>
#endif
#include "internal/pycore_code.h"
#define O(s, f) printf("%s.%s %zu\n", #s, #f, offsetof(s, f))
int main(void) {
    printf("version %s\n", PY_VERSION);
    O(_PyRuntimeState, interpreters.head);
#if PY_VERSION_HEX >= 0x030B0000
    O(PyInterpreterState, threads.head);
#else
    O(PyInterpreterState, tstate_head);
#endif
    O(PyThreadState, next);
    O(PyThreadState, thread_id);
#if PY_VERSION_HEX >= 0x030B0000
    O(PyThreadState, native_thread_id);
#endif
#if PY_VERSION_HEX >= 0x030D0000
    O(PyThreadState, current_frame);
    O(_PyInterpreterFrame, f_executable);
    O(_PyInterpreterFrame, previous);
    O(_PyInterpreterFrame, instr_ptr);
    O(_PyInterpreterFrame, owner);
#elif PY_VERSION_HEX >= 0x030B0000
    O(PyThreadState, cframe);
    O(_PyCFrame, current_frame);
    O(_PyInterpreterFrame, f_code);
    O(_PyInterpreterFrame, previous);
    O(_PyInterpreterFrame, prev_instr);
    O(_PyInterpreterFrame, owner);
#else
    O(PyThreadState, frame);
    O(PyFrameObject, f_back);
    O(PyFrameObject, f_code);
    O(PyFrameObject, f_lasti);
#endif
    O(PyCodeObject, co_filename);
    O(PyCodeObject, co_name);
#if PY_VERSION_HEX >= 0x030B0000
    O(PyCodeObject, co_qualname);
    O(PyCodeObject, co_code_adaptive);
#else
    O(PyCodeObject, co_code);
#endif
    O(PyCodeObject, co_firstlineno);
    O(PyCodeObject, co_linetable);
    O(PyBytesObject, ob_sval);
    O(PyVarObject, ob_size);
    printf("PyASCIIObject %zu\nPyCompactUnicodeObject %zu\n", sizeof(PyASCIIObject), sizeof(PyCompactUnicodeObject));
    O(PyASCIIObject, state);
    O(PyASCIIObject, length);
    return 0;
}
