"""Helpers shared by the test suite (servers, a scripted executor plugin)."""
