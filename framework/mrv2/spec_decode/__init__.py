"""Speculators shipped with the core (n-gram); the interface is :mod:`mrv2.contract.speculator`
and the verification :mod:`mrv2.sample.rejection`."""
