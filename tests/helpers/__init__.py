"""Shared checks the test suites (CPU interpreter and GPU) and the kernel benchmark call."""
