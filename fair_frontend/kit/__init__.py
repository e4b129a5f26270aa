"""The test kit: what the project's tests and benchmarks drive a frontend and a real
Triton with (``testing``), and the gate a test model holds its answers at (``gates``).
Nothing in the service imports it.

This package's own module imports nothing: Triton's Python-backend stub imports
``gates`` through it, in an interpreter that cannot load every extension module of the
virtual environment's.
"""
