"""Tools that operators bring: tool folders with a manifest, run by the ``wasm`` runner
(a WebAssembly module under wasmtime) or the ``process`` runner (a program in a fresh
OS sandbox per call). docs/tool-runners.md is the operator's and tool author's guide."""
