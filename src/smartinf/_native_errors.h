// Translates the core's C++ exceptions into Python ones (used as `except +raise_py_error`).
#pragma once
#include <Python.h>

#include <new>
#include <stdexcept>

#include "error.h"

inline void raise_py_error() {
  try {
    throw;
  } catch (const smartinf::SystemError& e) {
    PyObject* args = Py_BuildValue("(iss)", e.code(), e.what(), e.path().c_str());
    PyErr_SetObject(PyExc_OSError, args);
    Py_XDECREF(args);
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}
