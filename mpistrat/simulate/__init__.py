"""Simulating our collectives on clusters we do not have (SimGrid), checked on ours."""
