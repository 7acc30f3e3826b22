"""Builds retrograd._native (native/*.c through cffi) against the installed llama-cpp-python."""

from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
