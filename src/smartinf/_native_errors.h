// Translates the core's C++ exceptions into Python ones (used as `except +raise_py_error`).
#pragma once
#include <Python.h>

#include <cstring>
#include <new>
#include <stdexcept>

#include "error.h"

// Messages may quote bytes from a damaged file: undecodable ones become \xNN escapes.
inline void set_error(PyObject* type, const char* message) {
  PyObject* text = PyUnicode_DecodeUTF8(message, static_cast<Py_ssize_t>(strlen(message)),
                                        "backslashreplace");
  if (text) {
    PyErr_SetObject(type, text);
    Py_DECREF(text);
  }
}

inline void raise_py_error() {
  try {
    throw;
  } catch (const smartinf::SystemError& e) {
    PyObject* args = Py_BuildValue("(iss)", e.code(), e.what(), e.path().c_str());
    PyErr_SetObject(PyExc_OSError, args);
    Py_XDECREF(args);
  } catch (const std::invalid_argument& e) {
    set_error(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    set_error(PyExc_IndexError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    set_error(PyExc_RuntimeError, e.what());
  }
}
