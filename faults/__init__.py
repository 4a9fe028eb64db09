"""Fault injection on two network-namespace "nodes": harness, progress probes, scenarios, report."""
