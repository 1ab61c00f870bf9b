"""Load generator and benchmarks behind `zserve bench …`."""
