// pybind11 with torch's Tensor casters; the rest of <torch/extension.h> is not needed.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"
#include "thread_pool.h"

namespace {

// The Python signature of the decode stack: DecodeStackArgs' fields in order, the sparse ones
// next to last (decode_forward_sparse's callers pass them; decode_forward's leave them out), the
// 4-bit linears' scales last (by keyword).
at::Tensor decode_forward_py(at::Tensor x, at::Tensor residual, at::Tensor positions,
                             at::Tensor slots, std::vector<at::Tensor> weights,
                             at::Tensor final_norm, std::vector<at::Tensor> kv_caches,
                             at::Tensor cos, at::Tensor sin_signed, at::Tensor block_tables,
                             at::Tensor context_lens, int64_t block_size, double scale, double eps,
                             int64_t num_heads, int64_t num_kv_heads, int64_t team,
                             std::vector<at::Tensor> summaries, c10::optional<at::Tensor> topk,
                             int64_t dense_layers, c10::optional<at::Tensor> selected,
                             c10::optional<at::Tensor> stats, std::vector<at::Tensor> qweights) {
  return decode_forward(DecodeStackArgs{
      std::move(x), std::move(residual), std::move(positions), std::move(slots),
      std::move(weights), std::move(final_norm), std::move(kv_caches), std::move(cos),
      std::move(sin_signed), std::move(block_tables), std::move(context_lens), block_size, scale,
      eps, num_heads, num_kv_heads, team, std::move(summaries), topk.value_or(at::Tensor()),
      dense_layers, std::move(selected), std::move(stats), std::move(qweights)});
}

// Both names take the same arguments (positional, as the model passes them). The GIL is released
// once they are converted: the team runs for the whole step.
void def_decode_stack(py::module_& m, const char* name, const char* doc) {
  m.def(name, &decode_forward_py, doc, py::arg("x"), py::arg("residual"), py::arg("positions"),
        py::arg("slots"), py::arg("weights"), py::arg("final_norm"), py::arg("kv_caches"),
        py::arg("cos"), py::arg("sin_signed"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("eps"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("team"),
        py::arg("summaries") = std::vector<at::Tensor>(), py::arg("topk") = py::none(),
        py::arg("dense_layers") = 0, py::arg("selected") = py::none(),
        py::arg("stats") = py::none(), py::arg("qweights") = std::vector<at::Tensor>(),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, fp32)", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window") = 0);
  m.def("paged_prefill_supported", &paged_prefill_supported, "head dim and block size fit");
  m.def("paged_prefill_", &paged_prefill_, "causal prefill attention over the paged cache (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * w, in place");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * w over the last dim, out of place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rope_store_kv_", &rope_store_kv_, "RoPE on q/k in place, k/v stored at their slots");
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] -> 16-column panels");
  m.def("packed_linear", &packed_linear, "x W^T (+ b) over packed panels", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("q4_linear", &q4_linear, "x W^T (+ b) for 4-bit weight groups in panel order",
        py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("z"), py::arg("n"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("q8_linear", &q8_linear, "x W^T (+ b) for 8-bit weight groups in panel order",
        py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("n"), py::arg("bias") = py::none(),
        py::arg("z") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("q4i8_pack", &q4i8_pack, "4-bit codes, d, m -> q4i8_linear's 16-row units",
        py::arg("q"), py::arg("d"), py::arg("m"));
  m.def("q8_quantize", &q8_quantize, "x -> (int8 codes, dx, sx) per block of 32", py::arg("x"));
  m.def("q4i8_linear", &q4i8_linear, "x W^T (+ b), 4-bit weights x int8-rounded activations",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("q4_decode", &q4_decode, "4-bit weight groups in panel order -> fp32 [N, K]",
        py::arg("codes"), py::arg("d"), py::arg("z"), py::arg("n"), py::arg("bf16") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("q8_decode", &q8_decode, "8-bit weight groups in panel order -> fp32 [N, K]",
        py::arg("codes"), py::arg("d"), py::arg("n"), py::arg("z") = py::none(),
        py::arg("bf16") = false, py::call_guard<py::gil_scoped_release>());
  m.def("set_spin_us", &ts::set_spin_us, "how long idle workers stay awake between loops");
  m.def("spin_us", &ts::spin_us, "the current worker spin time");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum");
  def_decode_stack(m, "decode_forward", "the decoder layers for a decode-only step, by a team "
                   "of threads");
  def_decode_stack(m, "decode_forward_sparse", "decode_forward with sparse layers from "
                   "dense_layers on");
  m.def("sparse_paged_decode", &sparse_paged_decode, "top-k block (Quest) paged decode attention",
        py::arg("q"), py::arg("kv_cache"), py::arg("summary"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"), py::arg("topk"),
        py::arg("selected"), py::arg("stats"));
  // the same with one topk for every sequence
  m.def("sparse_paged_decode",
        [](at::Tensor q, at::Tensor kv_cache, at::Tensor summary,
           at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
           double scale, int64_t topk, at::Tensor selected, at::Tensor stats) {
          return sparse_paged_decode(q, kv_cache, summary, block_tables, context_lens,
                                     block_size, scale, at::full({q.size(0)}, topk, at::kLong),
                                     selected, stats);
        },
        py::arg("q"), py::arg("kv_cache"), py::arg("summary"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"), py::arg("topk"),
        py::arg("selected"), py::arg("stats"));
  m.def("kv_summary_update_", &kv_summary_update_, "each written key into its block's min/max",
        py::arg("kv_caches"), py::arg("summaries"), py::arg("slot_mapping"),
        py::arg("block_size"));
}
