"""Tests of the agentic tool layer, scenarios and verify specs (a package, so that its conftest does not shadow
tests/conftest.py for the modules that import from it)."""
