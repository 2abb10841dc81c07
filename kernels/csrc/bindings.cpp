#include "ops.h"
#include "thread_pool.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, fp32)");
  m.def("paged_prefill_supported", &paged_prefill_supported, "head dim and block size fit");
  m.def("paged_prefill_", &paged_prefill_, "causal prefill attention over the paged cache (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * w, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rope_store_kv_", &rope_store_kv_, "RoPE on q/k in place, k/v stored at their slots");
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] -> 16-column panels");
  m.def("packed_linear", &packed_linear, "x W^T (+ b) over packed panels", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("set_spin_us", &ts::set_spin_us, "how long idle workers stay awake between loops");
  m.def("spin_us", &ts::spin_us, "the current worker spin time");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum");
  m.def("decode_forward", &decode_forward, "the decoder layers for a decode-only step, by a "
        "team of threads", py::call_guard<py::gil_scoped_release>());
}
