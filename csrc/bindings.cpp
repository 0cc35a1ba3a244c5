// The Python module hetmoe._C: CPU features, ISA selection, the thread pool, MoEEngine and LinearEngine.
// Tensors cross as integer data pointers; hetmoe/kernels/engine.py validates every shape, dtype
// and stride before calling in, so nothing here trusts Python blindly and nothing links libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "decode_step.h"
#include "delta_rule.h"
#include "engine_common.h"
#include "gguf_rows.h"
#include "kernels.h"
#include "linear_engine.h"
#include "measure.h"
#include "method_traits.h"
#include "mla_step.h"
#include "moe_engine.h"
#include "norms.h"
#include "numa.h"
#include "quantize.h"
#include "routing.h"
#include "tile_path.h"

namespace py = pybind11;
using namespace hetmoe;

namespace {

const KernelTable* g_selected = nullptr;

const KernelTable* table_for(const std::string& isa) {
  const CpuFeatures& f = cpu_features();
  if (isa == "avx2") {
    if (!f.can_avx2()) throw py::value_error("HETMOE_ISA=avx2: this CPU or OS lacks AVX2+FMA+F16C");
    return avx2_kernels();
  }
  if (isa == "avx512") {
    if (!f.can_avx512())
      throw py::value_error("HETMOE_ISA=avx512: this CPU or OS lacks AVX-512 F/BW/VL/VNNI (or ZMM state)");
    return avx512_kernels();
  }
  if (isa == "amx") {
    if (!f.can_amx())
      throw py::value_error("HETMOE_ISA=amx: this CPU lacks AMX-TILE/INT8/BF16, or the OS did not grant tile data");
    return amx_kernels();
  }
  if (isa == "amx-emu") {  // the AMX kernels on emulated tiles: for tests, any AVX-512 CPU with BF16 and VBMI
    if (!f.can_amx_vector())
      throw py::value_error("HETMOE_ISA=amx-emu: the tile emulator runs the AMX unit's AVX-512 (with BF16 and VBMI) code; "
                            "this CPU lacks it");
    return amx_emu_kernels();
  }
  throw py::value_error("unknown ISA '" + isa + "': expected avx2, avx512, amx, amx-emu or auto");
}

std::string best_isa() {
  const CpuFeatures& f = cpu_features();
  if (f.can_amx()) return "amx";
  if (f.can_avx512()) return "avx512";
  if (f.can_avx2()) return "avx2";
  return "";
}

// (w, s, z, w_estride, w_rstride, s_estride, s_rstride, z_estride, z_rstride, n, k, group, s_row_div,
//  method, scale_kind): built and checked by hetmoe/runtime/engine_layout.py; re-checked here where a
// wrong value would make a kernel read out of bounds.
Proj proj_from(const py::tuple& t) {
  if (t.size() != 15) throw py::value_error("projection descriptor must have 15 fields");
  Proj p;
  p.w = reinterpret_cast<const uint8_t*>(t[0].cast<uintptr_t>());
  p.s = reinterpret_cast<const uint8_t*>(t[1].cast<uintptr_t>());
  p.z = reinterpret_cast<const uint8_t*>(t[2].cast<uintptr_t>());
  p.w_estride = t[3].cast<int64_t>();
  p.w_rstride = t[4].cast<int64_t>();
  p.s_estride = t[5].cast<int64_t>();
  p.s_rstride = t[6].cast<int64_t>();
  p.z_estride = t[7].cast<int64_t>();
  p.z_rstride = t[8].cast<int64_t>();
  p.n = t[9].cast<int>();
  p.k = t[10].cast<int>();
  p.group = t[11].cast<int>();
  p.s_row_div = t[12].cast<int>();
  p.method = t[13].cast<int>();
  p.scale_kind = t[14].cast<int>();
  if (p.method < 0 || p.method >= kNumMethods) throw py::value_error("unknown method id");
  if (p.k % 32 != 0 || p.n <= 0) throw py::value_error("K must be a multiple of 32 and N positive");
  if (p.s_row_div < 1) throw py::value_error("s_row_div must be >= 1");
  const bool pow2_blocks = p.group >= 32 && p.group % 32 == 0 && ((p.group / 32) & (p.group / 32 - 1)) == 0;
  if ((p.method == kInt4 || p.method == kMXFP4) && (!pow2_blocks || p.k % p.group != 0))
    throw py::value_error("4-bit group size must be 32 times a power of two (32, 64, 128, 256) and divide K");
  if (p.method == kMXFP4 && p.group != 32) throw py::value_error("mxfp4 scales cover 32 elements");
  if (p.method == kFP8 && (p.group <= 0 || p.group % 16 != 0))
    throw py::value_error("fp8 scale group must be a positive multiple of 16");
  if (p.method == kInt8 && p.scale_kind == kScaleF16 && (!pow2_blocks || p.k % p.group != 0))
    throw py::value_error("int8 group scales must cover 32 times a power of two elements and divide K");
  const MethodTraits& traits = method_traits(p.method);
  if (p.k % traits.k_multiple != 0)
    throw py::value_error(std::string(traits.name) + " rows must hold whole blocks of " +
                          std::to_string(traits.k_multiple) + " weights");
  if (p.method != kBF16 && !traits.scales_inside && !p.s) throw py::value_error("this method needs scales");
  return p;
}

// Per-head blocks (decode_step.h: head_gemv) from a projection descriptor whose experts are the heads:
// bf16 or a method with its scales inside its blocks (the GGUF types), heads not overlapping.
Proj head_blocks(const py::tuple& descriptor, const std::string& what) {
  const Proj p = proj_from(descriptor);
  if (p.method != kBF16 && !method_traits(p.method).scales_inside)
    throw py::value_error(what + ": a method with scales apart is not taken (GGUF block types and bf16 are)");
  if (p.w_estride < p.w_rstride * p.n) throw py::value_error(what + ": the heads' blocks overlap");
  return p;
}

// MLA's per-head blocks for DecodeMLABlock, N rows of K a head: (pointer, bytes between heads, bytes
// between rows) of bf16 blocks, or a descriptor (head_blocks).
Proj mla_head_blocks(const py::tuple& t, int64_t N, int64_t K, const char* name) {
  const std::string what = std::string("DecodeMLABlock: ") + name;
  if (t.size() == 3) {
    const auto w = t[0].cast<uintptr_t>();
    const auto head = t[1].cast<int64_t>(), row = t[2].cast<int64_t>();
    if (!w || row < 2 * K || head < row * N)
      throw py::value_error(what + ": bf16 blocks need a pointer, row bytes >= 2 K and head bytes >= N rows");
    return bf16_head_blocks(reinterpret_cast<const uint8_t*>(w), head, row, int(N), int(K));
  }
  if (t.size() != 15) throw py::value_error(what + ": expected (pointer, head bytes, row bytes) or a descriptor");
  const Proj p = head_blocks(t, what);
  if (p.n != N || p.k != K)
    throw py::value_error(what + ": expected " + std::to_string(N) + " rows of " + std::to_string(K) +
                          " per head, found " + std::to_string(p.n) + " of " + std::to_string(p.k));
  return p;
}

// A dense MLP for the one-call blocks (decode_step.h: DecodeMLP) from (gate_up, gate, up, down), engines
// or None: gate_up [hidden] -> [2 inter] or gate and up [hidden] -> [inter], down [inter] -> [hidden];
// all None: no MLP.
DecodeMLP mlp_from(const py::tuple& t, int64_t hidden, const std::string& what) {
  if (t.size() != 4) throw py::value_error(what + ": an MLP is (gate_up, gate, up, down)");
  DecodeMLP m{t[0].cast<LinearEngine*>(), t[1].cast<LinearEngine*>(), t[2].cast<LinearEngine*>(),
              t[3].cast<LinearEngine*>()};
  if (!m.down && !m.gate_up && !m.gate && !m.up) return m;
  const int64_t inter = m.down ? m.down->cols() : 0;
  const bool fused = m.gate_up && !m.gate && !m.up && m.gate_up->rows() == 2 * inter && m.gate_up->cols() == hidden;
  const bool apart = !m.gate_up && m.gate && m.up && m.gate->rows() == inter && m.up->rows() == inter &&
                     m.gate->cols() == hidden && m.up->cols() == hidden;
  if (!m.down || m.down->rows() != hidden || inter <= 0 || (!fused && !apart))
    throw py::value_error(what + ": the MLP must be gate_up [hidden] -> [2 inter] or gate and up [hidden] -> [inter], "
                                 "then down [inter] -> [hidden]");
  return m;
}

// A grouped router's spec (routing.h: GroupedTopk) from its Python fields, checked against its
// `experts` and `k` (`what` names the caller in the message).
GroupedTopk grouped_from(int64_t experts, int k, bool sigmoid, uintptr_t bias, int n_group, int topk_group,
                         bool group_by_max, bool masked_zero, bool normalize, double eps, double scaling,
                         const std::string& what) {
  if (experts <= 0 || k <= 0 || k > experts) throw py::value_error(what + ": needs 1 <= k <= experts");
  if (n_group <= 0 || experts % n_group || topk_group <= 0 || topk_group > n_group)
    throw py::value_error(what + ": n_group must divide the experts and 1 <= topk_group <= n_group");
  if (topk_group < n_group && !group_by_max && experts / n_group < 2)
    throw py::value_error(what + ": a group scored by its two largest needs two experts");
  GroupedTopk spec;
  spec.sigmoid = sigmoid;
  spec.bias = reinterpret_cast<const float*>(bias);
  spec.n_group = n_group;
  spec.topk_group = topk_group;
  spec.group_by_max = group_by_max;
  spec.masked_zero = masked_zero;
  spec.normalize = normalize;
  spec.eps = eps;
  spec.scaling = scaling;
  return spec;
}

// A one-call block's DecodeFFN (decode_step.h), set from Python (hetmoe/models/ffn_half.py) on either
// block: set_ffn_moe gives it a MoE block routed by grouped_topk (routing.h) from its router's fp32
// logits, or clears it with experts None; set_ffn_mlp gives it a dense MLP (all None: none). The
// router engine, experts and MLP engines are kept alive by the block; the fp32 router weight, the
// skip mask ([E] uint8), bias ([E] fp32 or 0) and counts ([E] int64 or 0) stay owned by Python.
template <typename Block>
void def_ffn(py::class_<Block>& cls) {
  cls.def(
         "set_ffn_moe",
         [](Block& b, LinearEngine* router, uintptr_t router_f32, MoEEngine* experts, uintptr_t skip_mask, int top_k,
            bool sigmoid, uintptr_t bias, int n_group, int topk_group, bool group_by_max, bool masked_zero,
            bool normalize, double eps, double scaling, uintptr_t counts, const py::tuple& shared) {
           DecodeFFN& f = b.ffn;
           if (!experts) {
             f.router = nullptr;
             f.router_f32 = nullptr;
             f.moe = DecodeMoEHalf{};
             return;
           }
           const int E = experts->experts();
           if (!router == !router_f32 || (router && (router->rows() != E || router->cols() != b.hidden)) ||
               b.hidden % 16)
             throw py::value_error("set_ffn_moe: one router (an engine linear or an fp32 weight) must map hidden (a "
                                   "multiple of 16) to one logit an expert");
           if (!skip_mask) throw py::value_error("set_ffn_moe: a null skip mask");
           DecodeMoEHalf moe;
           moe.experts = experts;
           moe.skip_mask = reinterpret_cast<const uint8_t*>(skip_mask);
           moe.top_k = top_k;
           moe.routing = kRouteGrouped;
           moe.grouped = grouped_from(E, top_k, sigmoid, bias, n_group, topk_group, group_by_max, masked_zero,
                                      normalize, eps, scaling, "set_ffn_moe");
           moe.counts = reinterpret_cast<int64_t*>(counts);
           moe.shared = mlp_from(shared, b.hidden, "set_ffn_moe: shared");
           f.router = router;
           f.router_f32 = reinterpret_cast<const float*>(router_f32);
           f.moe = moe;
         },
         py::arg("router").none(true), py::arg("router_f32"), py::arg("experts").none(true), py::arg("skip_mask") = 0,
         py::arg("top_k") = 0, py::arg("sigmoid") = true, py::arg("bias") = 0, py::arg("n_group") = 1,
         py::arg("topk_group") = 1, py::arg("group_by_max") = false, py::arg("masked_zero") = false,
         py::arg("normalize") = false, py::arg("eps") = 0.0, py::arg("scaling") = 1.0, py::arg("counts") = 0,
         py::arg("shared") = py::make_tuple(py::none(), py::none(), py::none(), py::none()), py::keep_alive<1, 2>(),
         py::keep_alive<1, 4>(), py::keep_alive<1, 17>())
      .def(
          "set_ffn_mlp", [](Block& b, const py::tuple& mlp) { b.ffn.mlp = mlp_from(mlp, b.hidden, "set_ffn_mlp"); },
          py::arg("mlp"), py::keep_alive<1, 2>());
}

// A MoE layer's projection against the layer's shape: gate and up map hidden to intermediate, down
// intermediate to hidden. A mismatch would make the kernels read past a row or write past the output.
void check_moe_proj(const char* name, const Proj& p, int rows, int cols) {
  if (p.n != rows || p.k != cols)
    throw py::value_error(std::string("MoEEngine: ") + name + " is " + std::to_string(p.n) + " x " +
                          std::to_string(p.k) + ", expected " + std::to_string(rows) + " x " + std::to_string(cols));
  if (!p.w) throw py::value_error(std::string("MoEEngine: ") + name + " has no weight pointer");
}

// The arguments of MoEEngine.submit and .forward (`call`), refused before any job exists: an id out of
// range would index past the weights (a plain loop: cheaper than the four torch ops the same check
// costs in Python).
void check_moe_call(const char* call, const MoEEngine& e, uintptr_t x, int x_dtype, int tokens, uintptr_t ids,
                    int topk, uintptr_t weights, uintptr_t y) {
  // the message's prefix only where one is thrown: a decode step's every layer passes here
  const auto refused = [call](const std::string& what) {
    return py::value_error(std::string("MoEEngine.") + call + ": " + what);
  };
  if (x_dtype != kF32 && x_dtype != kBF16Data)
    throw refused("x_dtype must be 0 (fp32) or 1 (bf16), got " + std::to_string(x_dtype));
  if (tokens < 0) throw refused("tokens must be >= 0, got " + std::to_string(tokens));
  if (topk < 1 || topk > e.experts())
    throw refused("topk must be in [1, " + std::to_string(e.experts()) + "], got " + std::to_string(topk));
  if (tokens > 0 && (!x || !ids || !weights || !y)) throw refused("x, ids, weights and y must not be null");
  const int64_t* id = reinterpret_cast<const int64_t*>(ids);
  for (int64_t i = 0, n = int64_t(tokens) * topk; i < n; ++i) {
    if (id[i] < -1 || id[i] >= e.experts()) {
      throw py::value_error("topk_ids: expected ids in [-1, " + std::to_string(e.experts()) + "), found " +
                            std::to_string(id[i]) + " at [" + std::to_string(i / topk) + ", " +
                            std::to_string(i % topk) + "]");
    }
  }
}

// MoEEngine.submit and .forward: the same arguments, checked, then run(engine, the pointers typed...)
// with the GIL released.
template <typename Run>
auto moe_call(const char* call, Run run) {
  return [call, run](MoEEngine& e, uintptr_t x, int x_dtype, int tokens, uintptr_t ids, int topk, uintptr_t weights,
                     uintptr_t y, uintptr_t skip) {
    check_moe_call(call, e, x, x_dtype, tokens, ids, topk, weights, y);
    py::gil_scoped_release release;
    return run(e, reinterpret_cast<const void*>(x), x_dtype, tokens, reinterpret_cast<const int64_t*>(ids), topk,
               reinterpret_cast<const float*>(weights), reinterpret_cast<void*>(y),
               reinterpret_cast<const uint8_t*>(skip));
  };
}

void check_linear_call(int x_dtype, int tokens, int y_dtype) {
  if (x_dtype != kF32 && x_dtype != kBF16Data) throw py::value_error("x_dtype must be 0 (fp32) or 1 (bf16)");
  if (y_dtype != kF32 && y_dtype != kBF16Data) throw py::value_error("y_dtype must be 0 (fp32) or 1 (bf16)");
  if (tokens < 0) throw py::value_error("tokens must be >= 0");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetmoe's compiled CPU engine";

  m.def("cpu_features", [] {
    const CpuFeatures& f = cpu_features();
    py::dict d;
    d["avx2"] = f.avx2, d["fma"] = f.fma, d["f16c"] = f.f16c;
    d["avx512f"] = f.avx512f, d["avx512bw"] = f.avx512bw, d["avx512vl"] = f.avx512vl;
    d["avx512_vnni"] = f.avx512vnni, d["avx512_bf16"] = f.avx512bf16, d["avx512_vbmi"] = f.avx512vbmi;
    d["amx_tile"] = f.amx_tile, d["amx_int8"] = f.amx_int8, d["amx_bf16"] = f.amx_bf16;
    d["os_ymm"] = f.os_ymm, d["os_zmm"] = f.os_zmm, d["os_amx"] = f.os_amx;
    d["amd"] = f.amd;
    d["can_avx2"] = f.can_avx2(), d["can_avx512"] = f.can_avx512(), d["can_amx"] = f.can_amx();
    d["can_amx-emu"] = f.can_amx_vector();
    return d;
  });
  m.def(
      "methods",
      [] {
        py::list rows;
        for (const MethodTraits& t : kMethodTraits) {
          py::dict d;
          d["id"] = int(t.method), d["name"] = t.name, d["block_weights"] = t.block_weights;
          d["block_bytes"] = t.block_bytes, d["bits_per_weight"] = t.bits_per_weight;
          d["scales_inside"] = t.scales_inside, d["k_multiple"] = t.k_multiple;
          // whose GEMV width and prefetch it follows (kernels.h IntWidthFamily)
          const int family = width_family(t.gemv_act);
          d["gemv_width"] = family == kWidthFloat ? "bf16" : family == kWidthNatural ? "int8" : "int4";
          rows.append(d);
        }
        return rows;
      },
      "the engine's storage methods, one traits row each (csrc/method_traits.h)");
  m.def("best_isa", &best_isa, "the best kernel variant this CPU runs ('' if none)");
  m.def(
      "tile_matmul",
      [](const std::string& isa, uintptr_t w_ptr, uintptr_t x_ptr, int R, int T, int K, bool w_lo, bool x_lo,
         uintptr_t c_ptr) {
        // For tests (tests/test_amx.py): c [T, R] = x [T, K] . w [R, K]^T (fp32, contiguous) through one AMX
        // variant's split, pack and tile GEMM, with or without each side's bf16 remainder.
        const KernelTable* kt = table_for(isa);
        if (!kt->amx_gemm) throw py::value_error("tile_matmul: '" + isa + "' has no tile kernels");
        if (R <= 0 || T <= 0 || K <= 0 || K % 32) throw py::value_error("tile_matmul: R, T > 0, K a multiple of 32");
        const float* w = reinterpret_cast<const float*>(w_ptr);
        const float* x = reinterpret_cast<const float*>(x_ptr);
        float* c = reinterpret_cast<float*>(c_ptr);
        py::gil_scoped_release release;
        std::vector<const float*> rows(T);
        for (int t = 0; t < T; ++t) rows[t] = x + size_t(t) * K;
        std::vector<uint16_t> xh(amx_packed_elems(T, K)), xl(amx_packed_elems(T, K));
        kt->amx_pack(rows.data(), T, K, xh.data(), x_lo ? xl.data() : nullptr);
        std::vector<float> panel(size_t(kAmxRows) * K);
        std::vector<uint16_t> wh(panel.size()), wl(panel.size());
        for (int r0 = 0; r0 < R; r0 += kAmxRows) {
          const int n = std::min(kAmxRows, R - r0);
          std::fill(panel.begin(), panel.end(), 0.f);
          std::memcpy(panel.data(), w + size_t(r0) * K, size_t(n) * K * sizeof(float));
          kt->amx_split(panel.data(), kAmxRows, K, wh.data(), w_lo ? wl.data() : nullptr);
          kt->amx_gemm(wh.data(), w_lo ? wl.data() : nullptr, K, n, K, xh.data(), x_lo ? xl.data() : nullptr, T,
                       c + r0, R);
        }
      },
      py::arg("isa"), py::arg("w"), py::arg("x"), py::arg("rows"), py::arg("tokens"), py::arg("k"), py::arg("w_lo"),
      py::arg("x_lo"), py::arg("c"));
  m.def(
      "activation_codes",
      [](const std::string& isa, uintptr_t x_ptr, int K, int layout, bool one_digit, uintptr_t q_ptr, uintptr_t d_ptr,
         uintptr_t sum_ptr) {
        // For tests (tests/test_activation_codes.py): one fp32 row x [K] quantized by a variant's
        // quantize_row into `layout` (kernels.h: ActQuant): q (2 K bytes), d (K / 32 floats), sum
        // (act_sums(layout, K) int32).
        const KernelTable* kt = table_for(isa);
        if (layout <= kActNone || layout > kActPairsHalves)
          throw py::value_error("activation_codes: layout 1-9 (kernels.h: ActQuant), found " + std::to_string(layout));
        if (K <= 0 || K % kActBlock) throw py::value_error("activation_codes: K a positive multiple of 32");
        py::gil_scoped_release release;
        kt->quantize_row(reinterpret_cast<const float*>(x_ptr), K, layout, reinterpret_cast<int16_t*>(q_ptr),
                         reinterpret_cast<float*>(d_ptr), reinterpret_cast<int32_t*>(sum_ptr), one_digit);
      },
      py::arg("isa"), py::arg("x"), py::arg("k"), py::arg("layout"), py::arg("one_digit"), py::arg("q"), py::arg("d"),
      py::arg("sum"));
  m.def(
      "tile_pack_digits",
      [](const std::string& isa, uintptr_t x_ptr, int T, int K, bool two_step, uintptr_t hi_ptr, uintptr_t lo_ptr,
         uintptr_t d_ptr) {
        // For tests (tests/test_amx.py): x [T, K] (fp32, contiguous) as int8 digit B tiles hi, lo
        // (amx_packed_elems(T, K) bytes each) and scales d (16 * ceil(T / 16) floats), by amx_pack_i8 or,
        // two_step, by amx_digit_rows a row and GroupTiles::pack_digit_rows (the MoE's path for gate and up).
        const KernelTable* kt = table_for(isa);
        if (!kt->amx_pack_i8) throw py::value_error("tile_pack_digits: '" + isa + "' has no tile kernels");
        if (T <= 0 || K <= 0 || K % 64) throw py::value_error("tile_pack_digits: T > 0, K a multiple of 64");
        const float* x = reinterpret_cast<const float*>(x_ptr);
        int8_t* hi = reinterpret_cast<int8_t*>(hi_ptr);
        int8_t* lo = reinterpret_cast<int8_t*>(lo_ptr);
        float* d = reinterpret_cast<float*>(d_ptr);
        py::gil_scoped_release release;
        std::vector<const float*> rows(T);
        for (int t = 0; t < T; ++t) rows[t] = x + size_t(t) * K;
        const size_t n = size_t(amx_packed_elems(T, K)), Tp = size_t(T + 15) / 16 * 16;
        if (!two_step) {
          std::vector<int8_t> th(n + 64), tl(n + 64);  // the kernel stores whole aligned lines
          kt->amx_pack_i8(rows.data(), T, K, engine::align64(th.data()), engine::align64(tl.data()), d);
          std::memcpy(hi, engine::align64(th.data()), n);
          std::memcpy(lo, engine::align64(tl.data()), n);
          return;
        }
        std::vector<int8_t> digits(size_t(2) * T * K + 64);
        int8_t* base = engine::align64(digits.data());
        std::vector<int8_t*> hr(T), lr(T);
        std::vector<float> row_d(T);
        for (int t = 0; t < T; ++t) {
          hr[t] = base + size_t(t) * K;
          lr[t] = base + size_t(T + t) * K;
          kt->amx_digit_rows(rows[t], K, hr[t], lr[t], &row_d[t]);
        }
        engine::TileForms digit_forms;
        digit_forms.digits = true;
        engine::GroupTiles tiles;
        tiles.plan({T}, K, digit_forms);
        for (int j = 0; j < tiles.items(); ++j)
          tiles.pack_digit_rows(kt, j, &hr[16 * j], &lr[16 * j], &row_d[16 * j], std::min(16, T - 16 * j));
        const engine::TileActs packed = tiles.acts(0);
        std::memcpy(hi, packed.q_hi, n);
        std::memcpy(lo, packed.q_lo, n);
        std::memcpy(d, packed.q_d, Tp * sizeof(float));
      },
      py::arg("isa"), py::arg("x"), py::arg("tokens"), py::arg("k"), py::arg("two_step"), py::arg("hi"), py::arg("lo"),
      py::arg("d"));
  m.def(
      "select_isa",
      [](const std::string& isa) {
        const std::string name = isa == "auto" ? best_isa() : isa;
        if (name.empty()) throw py::value_error("this CPU lacks AVX2+FMA+F16C: the compiled engine cannot run here");
        g_selected = table_for(name);
        return std::string(g_selected->name);
      },
      py::arg("isa"), "select the kernel variant for engines created from now on; raises if the CPU lacks it");
  m.def("selected_isa", [] { return std::string(g_selected ? g_selected->name : ""); });
  m.def(
      "measure_read_bandwidth",
      [](int64_t ptr, int64_t bytes, int threads, int repeats) {
        if (!ptr || bytes < 64 || threads < 1 || repeats < 1)
          throw py::value_error("measure_read_bandwidth: expected a buffer, bytes >= 64, threads and repeats >= 1");
        py::gil_scoped_release release;
        return measure_read_bandwidth(reinterpret_cast<uint64_t*>(ptr), bytes, threads, repeats);
      },
      py::arg("ptr"), py::arg("bytes"), py::arg("threads"), py::arg("repeats") = 5,
      "best GB/s streaming the caller's untouched buffer at `ptr`, each thread first touching its slice");
  m.def(
      "measure_read_bandwidth_of",
      [](int64_t ptr, int64_t bytes, int threads, int repeats) {
        if (!ptr || bytes < 64 || threads < 1 || repeats < 1)
          throw py::value_error("measure_read_bandwidth_of: expected a buffer, bytes >= 64, threads and repeats >= 1");
        py::gil_scoped_release release;
        return measure_read_bandwidth_of(reinterpret_cast<const uint64_t*>(ptr), bytes, threads, repeats);
      },
      py::arg("ptr"), py::arg("bytes"), py::arg("threads"), py::arg("repeats") = 3,
      "best GB/s streaming the caller's buffer at `ptr` (it must stay alive and hold `bytes`)");
  m.def(
      "measure_chunked_read",
      [](int64_t ptr, int64_t bytes, int64_t chunk, int64_t total, int reps, uint64_t seed) {
        if (!ptr || chunk < 64 || chunk % 64 || bytes < chunk || total < chunk || reps < 1)
          throw py::value_error(
              "measure_chunked_read: expected a buffer of bytes >= chunk, chunk a multiple of 64, total >= chunk, "
              "reps >= 1");
        py::gil_scoped_release release;
        return measure_chunked_read(reinterpret_cast<const uint8_t*>(ptr), bytes, chunk, total, reps, seed);
      },
      py::arg("ptr"), py::arg("bytes"), py::arg("chunk"), py::arg("total"), py::arg("reps") = 20,
      py::arg("seed") = 0, "median GB/s reading `total` bytes in random `chunk` pieces of the buffer on the pool");
  m.def(
      "measure_fma_peak",
      [](int threads, double seconds) {
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        py::gil_scoped_release release;
        return measure_fma_peak(g_selected, threads, seconds);
      },
      py::arg("threads"), py::arg("seconds") = 0.5, "GFLOP/s of fp32 FMA with the selected variant");
  m.def("set_num_threads", &set_pool_threads, py::arg("threads"));
  m.def("num_threads", &pool_threads);
  m.def("set_numa", &set_pool_numa, py::arg("spec"),
        "how the next pool splits into NUMA nodes: 'auto', 'off', a node count, or '' (HETMOE_NUMA)");
  m.def(
      "numa_info",
      [] {
        const NumaTopology& t = global_pool()->topology();
        py::dict d;
        d["source"] = t.source;
        d["node_cpus"] = t.node_cpus;
        d["memory_nodes"] = t.memory_node;
        d["libnuma"] = libnuma_loaded();
        return d;
      },
      "the pool's NUMA groups: their CPUs, the libnuma node each one's memory goes to, and where they came from");
  m.def(
      "page_node", [](uintptr_t addr) { return page_node(reinterpret_cast<const void*>(addr)); }, py::arg("addr"),
      "the NUMA node holding the page at addr (-1 where the kernel does not say)");
  m.def(
      "move_to_node",
      [](uintptr_t addr, int64_t bytes, int node) {
        if (bytes < 0 || node < 0) throw py::value_error("move_to_node: bytes and node must be >= 0");
        const auto* begin = reinterpret_cast<const uint8_t*>(addr);
        py::gil_scoped_release release;
        return move_to_node(begin, begin + bytes, node);
      },
      py::arg("addr"), py::arg("bytes"), py::arg("node"),
      "moves the pages that start inside [addr, addr + bytes) to a NUMA node; returns how many sit there after "
      "(-1: the kernel cannot move pages)");
  m.def("set_idle_spin_us", &ThreadPool::set_idle_spin_us, py::arg("us"));
  m.def(
      "rms_norm",
      [](uintptr_t x, uintptr_t w, uintptr_t y, int dtype, int64_t rows, int64_t cols, float eps, int mode) {
        // Shapes, dtypes and contiguity are checked in Python (hetmoe/models/fused_norms.py).
        if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("rms_norm: dtype must be 0 (fp32) or 1 (bf16)");
        if (mode < kNormCastThenScale || mode > kNormOffsetScale) throw py::value_error("rms_norm: unknown mode");
        if (rows < 0 || cols <= 0) throw py::value_error("rms_norm: rows must be >= 0 and cols > 0");
        py::gil_scoped_release release;
        rms_norm(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(w), reinterpret_cast<void*>(y), dtype,
                 rows, cols, eps, mode);
      },
      py::arg("x"), py::arg("w"), py::arg("y"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("eps"),
      py::arg("mode"));
  m.def(
      "attn_decode",
      [](uintptr_t q, uintptr_t k, uintptr_t v, int kv_dtype, int64_t batch, int64_t kv_heads, int groups, int64_t L,
         int D, py::tuple k_strides, py::tuple v_strides, uintptr_t mask, float scale, uintptr_t out, uintptr_t sinks) {
        // Shapes, dtypes and layouts are checked in Python (hetmoe/models/cpu_attention.py):
        // q fp32 [B, KV, G, D] contiguous; k, v [B, KV, L, D] with the given (batch, head, row)
        // strides in elements and unit stride along D; mask fp32 additive [B, L] contiguous or 0;
        // sinks fp32 [KV * G] contiguous or 0.
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (kv_dtype != kF32 && kv_dtype != kBF16Data) throw py::value_error("attn_decode: kv dtype must be 0 or 1");
        if (D <= 0 || D % 16 || groups <= 0 || L <= 0) throw py::value_error("attn_decode: bad shape");
        if (k_strides.size() != 3 || v_strides.size() != 3) throw py::value_error("attn_decode: 3 strides each");
        const int64_t kb = k_strides[0].cast<int64_t>(), kh = k_strides[1].cast<int64_t>(),
                      kr = k_strides[2].cast<int64_t>();
        const int64_t vb = v_strides[0].cast<int64_t>(), vh = v_strides[1].cast<int64_t>(),
                      vr = v_strides[2].cast<int64_t>();
        py::gil_scoped_release release;
        attn_decode_heads(g_selected, reinterpret_cast<const float*>(q), batch, kv_heads, groups, L, D,
                          reinterpret_cast<const uint8_t*>(k), kb, kh, kr, reinterpret_cast<const uint8_t*>(v), vb, vh,
                          vr, kv_dtype, reinterpret_cast<const float*>(mask), reinterpret_cast<const float*>(sinks),
                          scale, reinterpret_cast<float*>(out));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kv_dtype"), py::arg("batch"), py::arg("kv_heads"),
      py::arg("groups"), py::arg("length"), py::arg("dim"), py::arg("k_strides"), py::arg("v_strides"),
      py::arg("mask"), py::arg("scale"), py::arg("out"), py::arg("sinks") = 0);
  m.def(
      "head_gemv",
      [](const py::tuple& descriptor, int64_t heads, uintptr_t x, int64_t x_stride, uintptr_t y) {
        // y fp32 [heads, N] = W_h x_h per head h, W a projection descriptor (proj_from) whose experts are
        // the heads (MLA's attn_k_b / attn_v_b as a GGUF file stores them), x fp32 [heads][K] x_stride
        // floats apart (models/mla_decode.py; the decode step calls head_gemv itself).
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        const Proj p = head_blocks(descriptor, "head_gemv");
        if (heads <= 0 || x_stride < p.k) throw py::value_error("head_gemv: bad shape");
        py::gil_scoped_release release;
        head_gemv(g_selected, p, heads, reinterpret_cast<const float*>(x), x_stride, reinterpret_cast<float*>(y));
      },
      py::arg("descriptor"), py::arg("heads"), py::arg("x"), py::arg("x_stride"), py::arg("y"));
  m.def(
      "head_gemv_bf16",
      [](uintptr_t w, int64_t w_head, int64_t w_row, int64_t heads, int N, int K, uintptr_t x, int64_t x_stride,
         uintptr_t y) {
        // Layouts are checked in Python (hetmoe/models/mla_attention.py): bf16 blocks [heads][N][K]
        // with the given byte strides, x fp32 [heads][K] x_stride floats apart, y fp32 [heads, N].
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (heads <= 0 || N <= 0 || K <= 0 || K % 16 || w_row < 2 * int64_t(K) || x_stride < K)
          throw py::value_error("head_gemv_bf16: bad shape");
        py::gil_scoped_release release;
        head_gemv(g_selected, bf16_head_blocks(reinterpret_cast<const uint8_t*>(w), w_head, w_row, N, K), heads,
                  reinterpret_cast<const float*>(x), x_stride, reinterpret_cast<float*>(y));
      },
      py::arg("w"), py::arg("w_head"), py::arg("w_row"), py::arg("heads"), py::arg("n"), py::arg("k"), py::arg("x"),
      py::arg("x_stride"), py::arg("y"));
  m.def(
      "f32_to_bf16",
      [](uintptr_t src, uintptr_t dst, int64_t n) {
        // fp32 [n] -> bf16 [n], contiguous (checked in Python); the conversion the engine's bf16 paths use.
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (n < 0 || n > INT32_MAX) throw py::value_error("f32_to_bf16: bad length");
        g_selected->f32_to_bf16(reinterpret_cast<const float*>(src), reinterpret_cast<uint16_t*>(dst), int(n));
      },
      py::arg("src"), py::arg("dst"), py::arg("n"));
  m.def(
      "quantize_weights",
      [](const std::string& kind, const std::vector<uintptr_t>& parts, int64_t n, int64_t k, int64_t row_stride,
         int dtype, int group, bool asym, int min_zero, bool f16_scales, uintptr_t out0, uintptr_t out1, uintptr_t out2,
         const std::vector<uintptr_t>& scale_parts, int64_t scale_block_rows, int64_t scale_block_cols,
         int64_t scale_row_stride) {
        // Rows of `parts` (each n rows of k values of dtype, rows row_stride elements apart; fp8 codes
        // with their fp32 block scales, quantize.h) into the stored form of `kind` (quantize.h);
        // outputs laid out part after part and allocated by the caller (hetmoe/kernels/quantize.py,
        // which checks their sizes). Returns (NaN/Inf count, first row holding one or -1).
        if (!cpu_features().can_avx2()) throw py::value_error("quantize_weights: needs AVX2+FMA+F16C");
        if (parts.empty() || n <= 0 || k <= 0 || row_stride < k || dtype < kSrcF32 || dtype > kSrcF8E4M3)
          throw py::value_error("quantize_weights: bad source shape or dtype");
        for (uintptr_t p : parts)
          if (!p) throw py::value_error("quantize_weights: null source");
        if (dtype == kSrcF8E4M3) {
          if (scale_parts.size() != parts.size() || scale_block_rows <= 0 || scale_block_cols <= 0 ||
              scale_row_stride < (k + scale_block_cols - 1) / scale_block_cols)
            throw py::value_error("quantize_weights: fp8 needs one scale tensor per part and its block shape");
          for (uintptr_t p : scale_parts)
            if (!p) throw py::value_error("quantize_weights: null scales");
        }
        const int64_t block = kind == "mxfp4" ? 32 : gguf_block_elements(kind.c_str());
        if (block && k % block)
          throw py::value_error("quantize_weights: K must be a multiple of " + std::to_string(block));
        if (kind == "int4" && (group <= 0 || group % 8 || k % group))
          throw py::value_error("quantize_weights: int4 group must be a positive multiple of 8 dividing K");
        if (!out0 || ((kind == "int4" || kind == "int8" || kind == "fp8-channel" || kind == "mxfp4") && !out1) ||
            (kind == "int4" && asym && !out2))
          throw py::value_error("quantize_weights: missing output");
        QuantSource src;
        src.parts.reserve(parts.size());
        for (uintptr_t p : parts) src.parts.push_back(reinterpret_cast<const void*>(p));
        src.n = n, src.k = k, src.row_stride = row_stride, src.dtype = dtype;
        for (uintptr_t p : scale_parts) src.scale_parts.push_back(reinterpret_cast<const float*>(p));
        src.scale_block_rows = scale_block_rows, src.scale_block_cols = scale_block_cols;
        src.scale_row_stride = scale_row_stride;
        // the 512-bit row kernels where the CPU has them, unless the engine runs its AVX2 variant
        // (HETMOE_ISA=avx2: the tests then run the AVX2 quantizers too)
        src.avx512 = cpu_features().can_avx512() && !(g_selected && std::string(g_selected->name) == "avx2");
        QuantResult r;
        {
          py::gil_scoped_release release;
          if (kind == "int4")
            r = quantize_int4(src, group, asym, min_zero, f16_scales, reinterpret_cast<uint8_t*>(out0),
                              reinterpret_cast<uint16_t*>(out1), reinterpret_cast<uint8_t*>(out2));
          else if (kind == "int8")
            r = quantize_int8(src, reinterpret_cast<int8_t*>(out0), reinterpret_cast<float*>(out1));
          else if (kind == "fp8-channel")
            r = quantize_fp8_channel(src, reinterpret_cast<uint8_t*>(out0), reinterpret_cast<float*>(out1));
          else if (kind == "mxfp4")
            r = quantize_mxfp4(src, reinterpret_cast<uint8_t*>(out0), reinterpret_cast<uint8_t*>(out1));
          else
            r = quantize_gguf(src, kind.c_str(), reinterpret_cast<uint8_t*>(out0));  // -1: an unknown kind
        }
        if (r.nonfinite < 0) throw py::value_error("quantize_weights: unknown kind " + kind);
        return std::make_pair(r.nonfinite, r.first_bad_row);
      },
      py::arg("kind"), py::arg("parts"), py::arg("n"), py::arg("k"), py::arg("row_stride"), py::arg("dtype"),
      py::arg("group") = 0, py::arg("asym") = false, py::arg("min_zero") = 0, py::arg("f16_scales") = false, py::arg("out0") = 0,
      py::arg("out1") = 0, py::arg("out2") = 0, py::arg("scale_parts") = std::vector<uintptr_t>(),
      py::arg("scale_block_rows") = 1, py::arg("scale_block_cols") = 1, py::arg("scale_row_stride") = 0);
  m.def("gguf_row_kinds", &gguf_row_kinds, "The GGUF block types gguf_rows decodes, lower-case ggml names.");
  m.def(
      "gguf_rows",
      [](const std::string& kind, uintptr_t table, int64_t row_bytes, int64_t rows, uintptr_t ids, int64_t n,
         int64_t k, uintptr_t out) {
        // Checked in Python (hetmoe/runtime/stored_embedding.py): table uint8 [rows, row_bytes] contiguous,
        // ids int64 [n] contiguous, out fp32 [n, k] contiguous. Returns -1 or the position of the
        // first id outside the table.
        py::gil_scoped_release release;
        return gguf_rows(kind, reinterpret_cast<const uint8_t*>(table), row_bytes, rows,
                         reinterpret_cast<const int64_t*>(ids), n, k, reinterpret_cast<float*>(out));
      },
      py::arg("kind"), py::arg("table"), py::arg("row_bytes"), py::arg("rows"), py::arg("ids"), py::arg("n"),
      py::arg("k"), py::arg("out"));
  m.def("quantize_gguf_kinds", &gguf_quantize_kinds,
        "The GGUF block types quantize_weights writes, lower-case ggml names (csrc/quantize.cpp's table).");
  m.def(
      "attn_prefill",
      [](uintptr_t q, uintptr_t k, uintptr_t v, int kv_dtype, int64_t batch, int64_t heads, int64_t kv_heads,
         int64_t tokens, int64_t L, int Dk, int Dv, py::tuple k_strides, py::tuple v_strides, uintptr_t mask,
         int64_t mask_heads, int64_t past, bool causal, float scale, uintptr_t out, uintptr_t sinks) {
        // Shapes, dtypes and layouts are checked in Python (hetmoe/models/cpu_attention.py): q fp32
        // [B, H, T, Dk] contiguous; k [B, KV, L, Dk], v [B, KV, L, Dv] with the given (batch, head,
        // row) strides in elements and unit stride along D; mask fp32 additive [B, mask_heads, T, L]
        // contiguous or 0; sinks fp32 [H] contiguous or 0; out fp32 [B, T, H, Dv]. Causal: token t
        // sees keys l <= past + t.
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (kv_dtype != kF32 && kv_dtype != kBF16Data) throw py::value_error("attn_prefill: kv dtype must be 0 or 1");
        if (Dk <= 0 || Dk % 16 || Dv <= 0 || Dv % 16 || kv_heads <= 0 || heads % kv_heads || L <= 0 || tokens <= 0)
          throw py::value_error("attn_prefill: bad shape");
        if (mask && mask_heads != 1 && mask_heads != heads) throw py::value_error("attn_prefill: mask heads");
        if (k_strides.size() != 3 || v_strides.size() != 3) throw py::value_error("attn_prefill: 3 strides each");
        const int64_t kb = k_strides[0].cast<int64_t>(), kh = k_strides[1].cast<int64_t>(),
                      kr = k_strides[2].cast<int64_t>();
        const int64_t vb = v_strides[0].cast<int64_t>(), vh = v_strides[1].cast<int64_t>(),
                      vr = v_strides[2].cast<int64_t>();
        const size_t elem = kv_dtype == kBF16Data ? 2 : 4;
        const int64_t G = heads / kv_heads;
        constexpr int64_t kTokensPerItem = 16;  // x G query heads: the rows sharing one pass over K/V
        const int64_t blocks = (tokens + kTokensPerItem - 1) / kTokensPerItem;
        py::gil_scoped_release release;
        const KernelTable* kt = g_selected;
        const float* qf = reinterpret_cast<const float*>(q);
        const float* mf = reinterpret_cast<const float*>(mask);
        const float* sf = reinterpret_cast<const float*>(sinks);
        float* of = reinterpret_cast<float*>(out);
        // One item per (batch row, KV head, block of tokens), over the engine's pool; the later
        // tokens' blocks (longer causal prefixes) are claimed as the others finish.
        auto job = std::make_shared<ForJob>(int(batch * kv_heads * blocks), [=](int item) {
          thread_local std::vector<float> scratch;
          thread_local std::vector<const float*> qrows, mrows;
          thread_local std::vector<float*> orows;
          thread_local std::vector<int64_t> visible;
          thread_local std::vector<float> row_sinks;
          const int64_t b = item / (kv_heads * blocks), h = item / blocks % kv_heads, t0 = item % blocks * kTokensPerItem;
          const int64_t nt = std::min(kTokensPerItem, tokens - t0);
          const int M = int(G * nt);
          qrows.resize(M), mrows.resize(M), orows.resize(M), visible.resize(M), row_sinks.resize(M);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = h * G + g;
            for (int64_t i = 0; i < nt; ++i) {
              const int64_t t = t0 + i, m = g * nt + i;
              qrows[m] = qf + ((b * heads + head) * tokens + t) * Dk;
              orows[m] = of + ((b * tokens + t) * heads + head) * Dv;
              visible[m] = causal ? std::min(L, past + t + 1) : L;
              row_sinks[m] = sf ? sf[head] : 0.f;
              mrows[m] = mf ? mf + ((b * mask_heads + (mask_heads == 1 ? 0 : head)) * tokens + t) * L : nullptr;
            }
          }
          const size_t need = size_t(kAttnScratch(M, Dk, Dv));
          if (scratch.size() < need) scratch.resize(need);
          kt->attn_prefill(qrows.data(), M, visible.data(), reinterpret_cast<const uint8_t*>(k) + (b * kb + h * kh) * elem,
                           reinterpret_cast<const uint8_t*>(v) + (b * vb + h * vh) * elem, kv_dtype, Dk, Dv, kr, vr,
                           mf ? mrows.data() : nullptr, sf ? row_sinks.data() : nullptr, scale, orows.data(),
                           scratch.data());
        });
        global_pool()->submit(job);
        job->wait();
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kv_dtype"), py::arg("batch"), py::arg("heads"),
      py::arg("kv_heads"), py::arg("tokens"), py::arg("length"), py::arg("dk"), py::arg("dv"), py::arg("k_strides"),
      py::arg("v_strides"), py::arg("mask"), py::arg("mask_heads"), py::arg("past"), py::arg("causal"),
      py::arg("scale"), py::arg("out"), py::arg("sinks") = 0);
  m.def(
      "rope",
      [](uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t out, int dtype, int64_t batch, int64_t heads,
         int64_t tokens, int64_t dim, bool cos_batched) {
        // Shapes, dtypes and contiguity are checked in Python (hetmoe/models/fused_rope.py).
        if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("rope: dtype must be 0 (fp32) or 1 (bf16)");
        if (batch < 0 || heads < 0 || tokens < 0 || dim <= 0 || dim % 2) throw py::value_error("rope: bad shape");
        py::gil_scoped_release release;
        rope(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(cos), reinterpret_cast<const void*>(sin),
             reinterpret_cast<void*>(out), dtype, batch, heads, tokens, dim, cos_batched);
      },
      py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"), py::arg("dtype"), py::arg("batch"),
      py::arg("heads"), py::arg("tokens"), py::arg("dim"), py::arg("cos_batched"));
  m.def("idle_spin_us", &ThreadPool::idle_spin_us);
  m.def(
      "set_int_vector_bits",
      [](int bits, int family, int regime) {
        if (bits != 0 && bits != 256 && bits != 512)
          throw py::value_error("int vector bits: expected 256, 512 or 0 (this CPU's default), got " +
                                std::to_string(bits));
        if (family < -1 || family >= kWidthFamilies || regime < -1 || regime >= kWidthRegimes)
          throw py::value_error("int vector bits: family " + std::to_string(family) + ", regime " +
                                std::to_string(regime) + " (expected family 0-2, regime 0-1, -1 for all)");
        for (int f = 0; f < kWidthFamilies; ++f)
          for (int r = 0; r < kWidthRegimes; ++r)
            if ((family < 0 || family == f) && (regime < 0 || regime == r))
              g_int_vector_bits[f][r] = bits ? bits : default_int_vector_bits();
      },
      py::arg("bits"), py::arg("family") = -1, py::arg("regime") = -1,
      "the GEMVs' width for a family (0: 4-bit digits, 1: int16 codes, 2: bf16 on VDPBF16PS) and regime "
      "(0: decode, 1: more tokens), -1 for all");
  m.def(
      "int_vector_bits",
      [](int family, int regime) {
        if (family < 0 || family >= kWidthFamilies || regime < 0 || regime >= kWidthRegimes)
          throw py::value_error("int vector bits: family " + std::to_string(family) + ", regime " +
                                std::to_string(regime) + " (expected family 0-2, regime 0-1)");
        return g_int_vector_bits[family][regime].load();
      },
      py::arg("family"), py::arg("regime"));
  m.def(
      "set_weight_prefetch",
      [](int hint, int family) {
        if (hint < -1 || hint > kPrefetchNone)
          throw py::value_error(
              "weight prefetch: expected 0 (T0), 1 (NTA), 2 (T1), 3 (none) or -1 (this CPU's default), found " +
              std::to_string(hint));
        if (family < -1 || family >= kPrefetchFamilies)
          throw py::value_error("weight prefetch: family " + std::to_string(family) +
                                " (expected 0: 4- to 6-bit, 1: int8 and Q8_0, 2: bf16 and fp8, or -1 for all)");
        for (int f = 0; f < kPrefetchFamilies; ++f)
          if (family < 0 || family == f) g_weight_prefetch[f] = hint < 0 ? default_weight_prefetch() : hint;
      },
      py::arg("hint"), py::arg("family") = -1,
      "how a family of GEMVs prefetches the weight rows it streams (kernels.h: WeightPrefetch, PrefetchFamily)");
  m.def(
      "weight_prefetch",
      [](int family) {
        if (family < 0 || family >= kPrefetchFamilies)
          throw py::value_error("weight prefetch: family " + std::to_string(family) + " (expected 0, 1 or 2)");
        return g_weight_prefetch[family].load();
      },
      py::arg("family"));
  m.def(
      "set_activation_bits",
      [](int bits) {
        if (bits != 8 && bits != 16)
          throw py::value_error("activation bits: expected 16 (int16-level, the default) or 8, found " +
                                std::to_string(bits));
        g_act_one_digit = bits == 8;
      },
      py::arg("bits"),
      "the 4- to 6-bit GEMVs' activations: 16 (int16-level codes, two int8 digits) or 8 (one digit: "
      "llama.cpp's Q8 accuracy, the 512-bit GEMVs run half their products); from the next job (kernels.h)");
  m.def("activation_bits", [] { return g_act_one_digit.load() ? 8 : 16; });
  m.def(
      "buffer_cache_stats",
      [] {
        py::dict d;
        d["blocks"] = engine::buffer_cache().cached_sizes();
        d["max_bytes"] = engine::BufferCache::kCachedBytes;
        d["idle_gets"] = engine::BufferCache::kIdleGets;
        d["min_bytes"] = engine::BufferCache::kMinBytes;
        return d;
      },
      "the job-buffer cache: the sizes of the blocks it holds now, and its bounds (engine_common.h)");

  py::class_<MoEEngine>(m, "MoEEngine")
      .def(py::init([](int experts, int hidden, int intermediate, const py::tuple& gate, const py::tuple& up,
                       const py::tuple& down, int gemv_max_tokens, int activation, float alpha, float limit,
                       uintptr_t gate_bias, uintptr_t up_bias, uintptr_t down_bias) {
             if (!g_selected) throw py::value_error("select_isa() must be called first");
             if (activation != kSiluMul && activation != kSwigluOAI) throw py::value_error("unknown activation");
             ActConfig act;
             act.kind = activation;
             act.alpha = alpha;
             act.limit = limit;
             act.gate_bias = reinterpret_cast<const float*>(gate_bias);
             act.up_bias = reinterpret_cast<const float*>(up_bias);
             act.down_bias = reinterpret_cast<const float*>(down_bias);
             if (experts <= 0 || hidden <= 0 || intermediate <= 0)
               throw py::value_error("MoEEngine: experts, hidden and intermediate must be positive, got " +
                                     std::to_string(experts) + ", " + std::to_string(hidden) + ", " +
                                     std::to_string(intermediate));
             if (gemv_max_tokens < 0) throw py::value_error("MoEEngine: gemv_max_tokens must be >= 0");
             const Proj g = proj_from(gate), u = proj_from(up), d = proj_from(down);
             check_moe_proj("gate", g, intermediate, hidden);
             check_moe_proj("up", u, intermediate, hidden);
             check_moe_proj("down", d, hidden, intermediate);
             py::gil_scoped_release release;  // on a NUMA pool each node's rows are moved to it here
             return new MoEEngine(experts, hidden, intermediate, g, u, d, act, g_selected, gemv_max_tokens);
           }),
           py::arg("experts"), py::arg("hidden"), py::arg("intermediate"), py::arg("gate"), py::arg("up"),
           py::arg("down"), py::arg("gemv_max_tokens") = 4, py::arg("activation") = 0, py::arg("alpha") = 1.702f,
           py::arg("limit") = 7.0f, py::arg("gate_bias") = 0, py::arg("up_bias") = 0, py::arg("down_bias") = 0)
      .def(
          "submit",
          moe_call("submit", [](MoEEngine& e, auto... args) { return e.submit(args...); }),
          py::arg("x"), py::arg("x_dtype"), py::arg("tokens"), py::arg("ids"), py::arg("topk"), py::arg("weights"),
          py::arg("y"), py::arg("skip"))
      .def(
          "forward",
          moe_call("forward", [](MoEEngine& e, auto... args) { e.forward(args...); }),
          py::arg("x"), py::arg("x_dtype"), py::arg("tokens"), py::arg("ids"), py::arg("topk"), py::arg("weights"),
          py::arg("y"), py::arg("skip"),
          "submit and wait in one call, the GIL released throughout; no handle is kept")
      .def(
          "wait",
          [](MoEEngine& e, int64_t handle) {
            bool ok;
            {
              py::gil_scoped_release release;
              ok = e.wait(handle);
            }
            if (!ok) throw py::value_error("handle " + std::to_string(handle) + " is not pending (already waited on?)");
          },
          py::arg("handle"))
      .def_property_readonly("pending", &MoEEngine::pending)
      .def_property_readonly("isa", [](const MoEEngine& e) { return std::string(e.kernels()->name); })
      .def_property_readonly(
          "split",
          [](const MoEEngine& e) {
            py::list out;
            for (const NodeRows& r : e.split()) {
              py::dict d;
              d["up_rows"] = py::make_tuple(r.up0, r.up1);
              d["down_rows"] = py::make_tuple(r.down0, r.down1);
              d["memory_node"] = r.memory_node;
              out.append(d);
            }
            return out;
          },
          "the rows of every expert each NUMA node owns: gate's and up's (of the intermediate dimension), down's "
          "(of the hidden dimension), and the node their pages were moved to (-1: not moved)");

  py::class_<DecodeAttentionBlock> attention_block(m, "DecodeAttentionBlock");
  attention_block
      .def(py::init([](int dtype, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t D, const py::tuple& norms,
                       float scale, LinearEngine* qkv, LinearEngine* o_proj, LinearEngine* router, int qk_norm,
                       int64_t rotary_dim, uintptr_t sinks, LinearEngine* k_proj, LinearEngine* v_proj, bool gated) {
             // A decoder layer's attention half for one token (decode_step.h); norms: four (weight
             // pointer, eps, mode) for the input, q, k and post-attention norms (q and k: (0, 0, 0)
             // under qk_norm 0); sinks: fp32 [heads] or 0. Weights in `dtype` and the sinks stay owned
             // by Python (hetmoe/models/fast_decode.py keeps them with the block). gated: q_proj gives
             // each head's query then its gate (Qwen3-Next), heads * 2 * D rows.
             if (!g_selected) throw py::value_error("select_isa() must be called first");
             if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("DecodeAttentionBlock: dtype must be 0 or 1");
             if (hidden <= 0 || D <= 0 || D % 16 || kv_heads <= 0 || heads % kv_heads || norms.size() != 4)
               throw py::value_error("DecodeAttentionBlock: bad shape");
             if (!k_proj != !v_proj) throw py::value_error("DecodeAttentionBlock: k_proj and v_proj go together");
             const int64_t q_rows = heads * D * (gated ? 2 : 1);
             if (k_proj) {
               if (!qkv || qkv->cols() != hidden || qkv->rows() != q_rows || k_proj->cols() != hidden ||
                   k_proj->rows() != kv_heads * D || v_proj->cols() != hidden || v_proj->rows() != kv_heads * D)
                 throw py::value_error("DecodeAttentionBlock: q, k_proj, v_proj must map hidden to heads * D (gated: "
                                       "heads * 2 * D), kv_heads * D, kv_heads * D");
             } else if (!qkv || qkv->cols() != hidden || qkv->rows() != q_rows + 2 * kv_heads * D) {
               throw py::value_error(
                   "DecodeAttentionBlock: qkv must map hidden to (heads + 2 kv_heads) * D (gated: (2 heads + 2 kv_heads) * D)");
             }
             if (!o_proj || o_proj->cols() != heads * D || o_proj->rows() != hidden)
               throw py::value_error("DecodeAttentionBlock: o_proj must map heads * D to hidden");
             if (router && router->cols() != hidden) throw py::value_error("DecodeAttentionBlock: router input");
             if (qk_norm < kQKNormNone || qk_norm > kQKNormProjection)
               throw py::value_error("DecodeAttentionBlock: qk_norm must be 0 (none), 1 (per head) or 2 (projection)");
             if (rotary_dim <= 0 || rotary_dim > D || rotary_dim % 2)
               throw py::value_error("DecodeAttentionBlock: rotary_dim must be even and in [2, dim]");
             NormSpec spec[4];
             for (int i = 0; i < 4; ++i) {
               const py::tuple n = norms[i].cast<py::tuple>();
               spec[i] = {reinterpret_cast<const void*>(n[0].cast<uintptr_t>()), n[1].cast<float>(), n[2].cast<int>()};
               const bool used = i == 0 || i == 3 || qk_norm != kQKNormNone;
               if (used && (!spec[i].weight || spec[i].mode < kNormCastThenScale || spec[i].mode > kNormOffsetScale))
                 throw py::value_error("DecodeAttentionBlock: norm " + std::to_string(i) + " needs a weight and a mode");
             }
             return new DecodeAttentionBlock{g_selected,
                                             dtype,
                                             hidden,
                                             heads,
                                             kv_heads,
                                             D,
                                             spec[0],
                                             spec[1],
                                             spec[2],
                                             spec[3],
                                             qk_norm,
                                             rotary_dim,
                                             reinterpret_cast<const float*>(sinks),
                                             scale,
                                             qkv,
                                             k_proj,
                                             v_proj,
                                             o_proj,
                                             router,
                                             gated,
                                             DecodeMoEHalf{},
                                             DecodeFFN{}};
           }),
           py::arg("dtype"), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("dim"),
           py::arg("norms"), py::arg("scale"), py::arg("qkv"), py::arg("o_proj"), py::arg("router").none(true),
           py::arg("qk_norm"), py::arg("rotary_dim"), py::arg("sinks"), py::arg("k_proj").none(true) = nullptr,
           py::arg("v_proj").none(true) = nullptr, py::arg("gated") = false, py::keep_alive<1, 9>(), py::keep_alive<1, 10>(),
           py::keep_alive<1, 11>(), py::keep_alive<1, 15>(), py::keep_alive<1, 16>())
      .def(
          "run",
          [](const DecodeAttentionBlock& b, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t kbuf, uintptr_t vbuf,
             int64_t k_head_stride, int64_t k_row_stride, int64_t v_head_stride, int64_t v_row_stride, int64_t position,
             int64_t capacity, uintptr_t x_out, uintptr_t h_out, uintptr_t logits, int64_t first) {
            // The new K/V row goes to `position` of buffers holding `capacity` rows a head: past them the
            // write would land in the next head's rows or outside the buffers.
            if (position < 0 || position >= capacity)
              throw py::value_error("DecodeAttentionBlock.run: position " + std::to_string(position) +
                                    " is outside the cache's " + std::to_string(capacity) + " rows");
            if (first < 0 || first > position)
              throw py::value_error("DecodeAttentionBlock.run: first row " + std::to_string(first) +
                                    " is not in [0, position " + std::to_string(position) + "]");
            if (k_row_stride < b.D || v_row_stride < b.D || k_head_stride < capacity * k_row_stride ||
                v_head_stride < capacity * v_row_stride)
              throw py::value_error("DecodeAttentionBlock.run: cache strides overlap rows or heads");
            if (!x || !cos || !sin || !kbuf || !vbuf || !x_out || !h_out || (b.router != nullptr) != (logits != 0))
              throw py::value_error("DecodeAttentionBlock.run: a null buffer (logits: exactly when a router is set)");
            py::gil_scoped_release release;
            return b.run(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(cos),
                  reinterpret_cast<const void*>(sin),
                  {reinterpret_cast<uint8_t*>(kbuf), reinterpret_cast<uint8_t*>(vbuf), k_head_stride, k_row_stride,
                   v_head_stride, v_row_stride, position, first},
                  reinterpret_cast<void*>(x_out), reinterpret_cast<void*>(h_out), reinterpret_cast<void*>(logits));
          },
          py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kbuf"), py::arg("vbuf"), py::arg("k_head_stride"),
          py::arg("k_row_stride"), py::arg("v_head_stride"), py::arg("v_row_stride"), py::arg("position"),
          py::arg("capacity"), py::arg("x_out"), py::arg("h_out"), py::arg("logits"), py::arg("first") = 0)
      .def(
          "set_moe",
          [](DecodeAttentionBlock& b, MoEEngine* experts, uintptr_t skip_mask, int top_k, bool normalize,
             bool round_bf16, uintptr_t counts, uintptr_t grouped_bias, const py::tuple& shared,
             LinearEngine* shared_gate) {
            // The layer's MoE half (decode_step.h: DecodeMoEHalf) routed from the block's logits, or none
            // with experts None: by softmax top-k (routing.h: softmax_topk), or, with grouped_bias, by
            // MiniMax-M2's router (grouped_topk on the logits taken to fp32: sigmoid, the bias [E] fp32
            // for the choice, one group, renormalised). The mask ([E] uint8), bias and counts ([E] int64,
            // or 0) stay owned by Python, as the engine's own are. shared: the shared experts' MLP (all
            // None: none), shared_gate their sigmoid gate ([hidden] -> [1], or None).
            DecodeMoEHalf moe;
            if (experts) {
              if (shared_gate && (shared_gate->rows() != 1 || shared_gate->cols() != b.hidden))
                throw py::value_error("DecodeAttentionBlock.set_moe: shared_gate must map hidden to one value");
              if (!b.router || b.router->rows() != experts->experts())
                throw py::value_error("DecodeAttentionBlock.set_moe: the block's router must give one logit an expert");
              if (top_k <= 0 || top_k > experts->experts())
                throw py::value_error("DecodeAttentionBlock.set_moe: top_k must be in [1, experts]");
              if (!skip_mask) throw py::value_error("DecodeAttentionBlock.set_moe: a null skip mask");
              moe.experts = experts;
              moe.skip_mask = reinterpret_cast<const uint8_t*>(skip_mask);
              moe.top_k = top_k;
              moe.routing = grouped_bias ? kRouteGrouped : kRouteSoftmaxTopk;
              moe.normalize = normalize;
              moe.round_bf16 = round_bf16;
              moe.grouped.sigmoid = true;
              moe.grouped.bias = reinterpret_cast<const float*>(grouped_bias);
              moe.grouped.normalize = normalize;
              moe.counts = reinterpret_cast<int64_t*>(counts);
              moe.shared = mlp_from(shared, b.hidden, "DecodeAttentionBlock.set_moe: shared");
              moe.shared_gate = moe.shared.down ? shared_gate : nullptr;
            }
            b.moe = moe;
          },
          py::arg("experts").none(true), py::arg("skip_mask") = 0, py::arg("top_k") = 0, py::arg("normalize") = false,
          py::arg("round_bf16") = false, py::arg("counts") = 0, py::arg("grouped_bias") = 0,
          py::arg("shared") = py::make_tuple(py::none(), py::none(), py::none(), py::none()),
          py::arg("shared_gate").none(true) = py::none(), py::keep_alive<1, 2>(), py::keep_alive<1, 9>(),
          py::keep_alive<1, 10>());
  def_ffn(attention_block);

  m.def(
      "softmax_topk",
      [](uintptr_t logits, int dtype, int64_t rows, int64_t experts, int k, bool normalize, bool round_bf16,
         uintptr_t ids, uintptr_t weights) {
        // routing.h; tensors checked in Python (hetmoe/models/adapters/routing.py)
        if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("softmax_topk: dtype must be 0 or 1");
        if (rows < 0 || experts <= 0 || k <= 0 || k > experts)
          throw py::value_error("softmax_topk: needs rows >= 0 and 1 <= k <= experts");
        if (!logits || !ids || !weights) throw py::value_error("softmax_topk: a null buffer");
        py::gil_scoped_release release;
        softmax_topk(reinterpret_cast<const void*>(logits), dtype, rows, experts, k, normalize, round_bf16,
                     reinterpret_cast<int64_t*>(ids), reinterpret_cast<float*>(weights));
      },
      py::arg("logits"), py::arg("dtype"), py::arg("rows"), py::arg("experts"), py::arg("k"), py::arg("normalize"),
      py::arg("round_bf16"), py::arg("ids"), py::arg("weights"));

  m.def(
      "router_logits_f32",
      [](uintptr_t w, int64_t rows, int64_t cols, uintptr_t x, int64_t T, uintptr_t out) {
        // routing.h; fp32 tensors checked in Python (hetmoe/models/adapters/routing.py)
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (rows <= 0 || cols <= 0 || cols % 16 || T < 0)
          throw py::value_error("router_logits_f32: needs rows > 0 and cols a positive multiple of 16");
        if (!w || !x || !out) throw py::value_error("router_logits_f32: a null buffer");
        py::gil_scoped_release release;
        router_logits_f32(g_selected, reinterpret_cast<const float*>(w), rows, cols, reinterpret_cast<const float*>(x),
                          T, reinterpret_cast<float*>(out));
      },
      py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("tokens"), py::arg("out"));

  m.def(
      "grouped_topk",
      [](uintptr_t logits, int64_t rows, int64_t experts, int k, bool sigmoid, uintptr_t bias, int n_group,
         int topk_group, bool group_by_max, bool masked_zero, bool normalize, double eps, double scaling, uintptr_t ids,
         uintptr_t weights) {
        // routing.h; fp32 logits [rows, experts] and bias [experts] checked in Python
        // (hetmoe/models/adapters/routing.py)
        if (rows < 0) throw py::value_error("grouped_topk: needs rows >= 0");
        const GroupedTopk spec = grouped_from(experts, k, sigmoid, bias, n_group, topk_group, group_by_max,
                                              masked_zero, normalize, eps, scaling, "grouped_topk");
        if (!logits || !ids || !weights) throw py::value_error("grouped_topk: a null buffer");
        py::gil_scoped_release release;
        grouped_topk(reinterpret_cast<const float*>(logits), rows, experts, k, spec, reinterpret_cast<int64_t*>(ids),
                     reinterpret_cast<float*>(weights));
      },
      py::arg("logits"), py::arg("rows"), py::arg("experts"), py::arg("k"), py::arg("sigmoid"), py::arg("bias"),
      py::arg("n_group"), py::arg("topk_group"), py::arg("group_by_max"), py::arg("masked_zero"), py::arg("normalize"),
      py::arg("eps"), py::arg("scaling"), py::arg("ids"), py::arg("weights"));

  m.def(
      "gated_delta_step",
      [](uintptr_t q, uintptr_t k, uintptr_t v, int dtype, uintptr_t g, uintptr_t beta, uintptr_t state, uintptr_t out,
         int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv) {
        // One token of Qwen3-Next's gated delta rule (delta_rule.h); tensors checked in Python
        // (hetmoe/models/delta_rule.py), the state updated in place.
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("gated_delta_step: dtype must be 0 or 1");
        if (k_heads <= 0 || v_heads <= 0 || v_heads % k_heads || dk <= 0 || dv <= 0)
          throw py::value_error("gated_delta_step: bad shape (v_heads a multiple of k_heads)");
        if (!q || !k || !v || !g || !beta || !state || !out) throw py::value_error("gated_delta_step: a null buffer");
        py::gil_scoped_release release;
        gated_delta_step(g_selected, reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(k),
                         reinterpret_cast<const void*>(v), dtype, reinterpret_cast<const float*>(g),
                         reinterpret_cast<const float*>(beta), reinterpret_cast<float*>(state),
                         reinterpret_cast<void*>(out), k_heads, v_heads, dk, dv);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dtype"), py::arg("g"), py::arg("beta"), py::arg("state"),
      py::arg("out"), py::arg("k_heads"), py::arg("v_heads"), py::arg("dk"), py::arg("dv"));

  py::class_<DecodeMLABlock> mla_block(m, "DecodeMLABlock");
  mla_block
      .def(py::init([](int64_t hidden, int64_t heads, int64_t nope, int64_t rope, int64_t rank, int64_t v_dim,
                       int64_t q_rank, const py::tuple& norms, int rope_mode, float scale, LinearEngine* q_in,
                       LinearEngine* kv_a, LinearEngine* q_b, const py::tuple& w_uk_t, const py::tuple& w_uv,
                       LinearEngine* o_proj) {
             // A latent-attention layer's attention half for one token, bf16 (mla_step.h); norms: four
             // (weight pointer, eps, mode) for the input, q_a (0, 0, 0 without q_rank), kv_a and
             // post-attention norms; w_uk_t, w_uv: (pointer, bytes between heads, bytes between rows)
             // of bf16 blocks, or descriptors whose experts are the heads (mla_head_blocks). Everything stays
             // owned by Python (hetmoe/models/mla_decode.py).
             if (!g_selected) throw py::value_error("select_isa() must be called first");
             if (hidden <= 0 || heads <= 0 || nope <= 0 || nope % 16 || rank <= 0 || rank % 16 || rope <= 0 ||
                 rope % 16 || v_dim <= 0 || q_rank < 0 || norms.size() != 4)
               throw py::value_error("DecodeMLABlock: bad shape (nope, rank and rope must be multiples of 16)");
             if (rope_mode < kMLARopeInterleaved || rope_mode > kMLARopeComplex)
               throw py::value_error("DecodeMLABlock: rope_mode must be 0 (interleaved), 1 (half) or 2 (complex)");
             const int64_t q_cols = heads * (nope + rope), dk = rank + rope;
             const int64_t q_in_rows = q_rank ? q_rank : q_cols;
             if (!q_in || q_in->cols() != hidden || q_in->rows() != q_in_rows + (kv_a ? 0 : dk))
               throw py::value_error("DecodeMLABlock: q_in must map hidden to q_rank or heads * (nope + rope), then "
                                     "rank + rope rows where kv_a is not given");
             if (kv_a && (kv_a->cols() != hidden || kv_a->rows() != dk))
               throw py::value_error("DecodeMLABlock: kv_a must map hidden to rank + rope");
             if (!q_rank != !q_b || (q_b && (q_b->cols() != q_rank || q_b->rows() != q_cols)))
               throw py::value_error("DecodeMLABlock: q_b (exactly with q_rank) must map q_rank to heads * (nope + rope)");
             if (!o_proj || o_proj->cols() != heads * v_dim || o_proj->rows() != hidden)
               throw py::value_error("DecodeMLABlock: o_proj must map heads * v_dim to hidden");
             NormSpec spec[4];
             for (int i = 0; i < 4; ++i) {
               const py::tuple n = norms[i].cast<py::tuple>();
               spec[i] = {reinterpret_cast<const void*>(n[0].cast<uintptr_t>()), n[1].cast<float>(), n[2].cast<int>()};
               const bool used = i != 1 || q_rank;
               if (used && (!spec[i].weight || spec[i].mode < kNormCastThenScale || spec[i].mode > kNormOffsetScale))
                 throw py::value_error("DecodeMLABlock: norm " + std::to_string(i) + " needs a weight and a mode");
             }
             const Proj uk = mla_head_blocks(w_uk_t, rank, nope, "w_uk_t");
             const Proj uv = mla_head_blocks(w_uv, v_dim, rank, "w_uv");
             return new DecodeMLABlock{g_selected,
                                       hidden,
                                       heads,
                                       nope,
                                       rope,
                                       rank,
                                       v_dim,
                                       q_rank,
                                       spec[0],
                                       spec[1],
                                       spec[2],
                                       spec[3],
                                       rope_mode,
                                       scale,
                                       q_in,
                                       kv_a,
                                       q_b,
                                       uk,
                                       uv,
                                       o_proj,
                                       {}};
           }),
           py::arg("hidden"), py::arg("heads"), py::arg("nope"), py::arg("rope"), py::arg("rank"), py::arg("v_dim"),
           py::arg("q_rank"), py::arg("norms"), py::arg("rope_mode"), py::arg("scale"), py::arg("q_in"),
           py::arg("kv_a").none(true), py::arg("q_b").none(true), py::arg("w_uk_t"), py::arg("w_uv"),
           py::arg("o_proj"), py::keep_alive<1, 12>(), py::keep_alive<1, 13>(), py::keep_alive<1, 14>(),
           py::keep_alive<1, 17>())
      .def(
          "run",
          [](const DecodeMLABlock& b, uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t cache, int64_t row_stride,
             int64_t position, int64_t capacity, uintptr_t x_out, uintptr_t h_out) {
            if (position < 0 || position >= capacity)
              throw py::value_error("DecodeMLABlock.run: position " + std::to_string(position) +
                                    " is outside the cache's " + std::to_string(capacity) + " rows");
            if (row_stride < b.rank + b.rope)
              throw py::value_error("DecodeMLABlock.run: cache rows of " + std::to_string(row_stride) +
                                    " elements are narrower than rank + rope");
            if (!x || !cos || (!sin && b.rope_mode != kMLARopeComplex) || !cache || !x_out || !h_out)
              throw py::value_error("DecodeMLABlock.run: a null buffer");
            py::gil_scoped_release release;
            return b.run(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(cos),
                         reinterpret_cast<const void*>(sin), reinterpret_cast<uint8_t*>(cache), row_stride, position,
                         reinterpret_cast<void*>(x_out), reinterpret_cast<void*>(h_out));
          },
          py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("cache"), py::arg("row_stride"), py::arg("position"),
          py::arg("capacity"), py::arg("x_out"), py::arg("h_out"));
  def_ffn(mla_block);

  m.def(
      "sigmoid_rounded",
      [](uintptr_t x, int dtype, int64_t n, uintptr_t out) {
        // decode_step.h; tensors checked in Python (hetmoe/runtime/engine_activations.py)
        if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("sigmoid_rounded: dtype must be 0 or 1");
        if (n < 0 || !x || !out) throw py::value_error("sigmoid_rounded: needs n >= 0 and two buffers");
        py::gil_scoped_release release;
        sigmoid_rounded(reinterpret_cast<const void*>(x), dtype, n, reinterpret_cast<void*>(out));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("out"));

  m.def(
      "silu_rounded",
      [](uintptr_t x, int dtype, int64_t n, uintptr_t out) {
        // decode_step.h; tensors checked in Python (hetmoe/runtime/engine_activations.py)
        if (!g_selected) throw py::value_error("select_isa() must be called first");
        if (dtype != kF32 && dtype != kBF16Data) throw py::value_error("silu_rounded: dtype must be 0 or 1");
        if (n < 0 || !x || !out) throw py::value_error("silu_rounded: needs n >= 0 and two buffers");
        py::gil_scoped_release release;
        silu_rounded(g_selected, reinterpret_cast<const void*>(x), dtype, n, reinterpret_cast<void*>(out));
      },
      py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("out"));

  py::class_<LinearEngine>(m, "LinearEngine")
      .def(py::init([](const py::tuple& weight, uintptr_t bias, int gemv_max_tokens) {
             if (!g_selected) throw py::value_error("select_isa() must be called first");
             if (gemv_max_tokens < 0) throw py::value_error("gemv_max_tokens must be >= 0");
             return new LinearEngine(proj_from(weight), reinterpret_cast<const float*>(bias), g_selected,
                                     gemv_max_tokens);
           }),
           py::arg("weight"), py::arg("bias") = 0, py::arg("gemv_max_tokens") = 4)
      .def(
          "submit",
          [](LinearEngine& e, uintptr_t x, int x_dtype, int tokens, uintptr_t y, int y_dtype) {
            check_linear_call(x_dtype, tokens, y_dtype);
            py::gil_scoped_release release;
            return e.submit(reinterpret_cast<const void*>(x), x_dtype, tokens, reinterpret_cast<void*>(y), y_dtype);
          },
          py::arg("x"), py::arg("x_dtype"), py::arg("tokens"), py::arg("y"), py::arg("y_dtype"))
      .def(
          "forward",
          [](LinearEngine& e, uintptr_t x, int x_dtype, int tokens, uintptr_t y, int y_dtype) {
            check_linear_call(x_dtype, tokens, y_dtype);
            py::gil_scoped_release release;
            e.wait(e.submit(reinterpret_cast<const void*>(x), x_dtype, tokens, reinterpret_cast<void*>(y), y_dtype));
          },
          py::arg("x"), py::arg("x_dtype"), py::arg("tokens"), py::arg("y"), py::arg("y_dtype"),
          "submit and wait in one call, the GIL released throughout")
      .def(
          "wait",
          [](LinearEngine& e, int64_t handle) {
            bool ok;
            {
              py::gil_scoped_release release;
              ok = e.wait(handle);
            }
            if (!ok) throw py::value_error("handle " + std::to_string(handle) + " is not pending (already waited on?)");
          },
          py::arg("handle"))
      .def_property_readonly("pending", &LinearEngine::pending)
      .def_property_readonly("node_bounds", &LinearEngine::node_bounds,
                             "where the output rows are cut per NUMA node of the pool: node j owns rows "
                             "[bounds[j], bounds[j + 1]), its pages moved to it ([0, N] on one node)")
      .def_property_readonly("out_features", &LinearEngine::rows)
      .def_property_readonly("in_features", &LinearEngine::cols)
      .def_property_readonly("isa", [](const LinearEngine& e) { return std::string(e.kernels()->name); });
}
