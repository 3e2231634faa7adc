// kreg's binding of FlashMLA's SM90 sparse-prefill forward, for benchmarks/flashmla_peer.py: one op,
// torch.ops.kreg_flashmla_peer.sparse_prefill(q, kv, indices, sm_scale, d_v) -> (out, max_logits, lse),
// with FlashMLA's layouts (q [s_q, h_q, d_qk], kv [s_kv, h_kv, d_qk], indices [s_q, h_kv, topk] int32)
// and no sink or topk_length. Built against FlashMLA's sources that `flashmla_peer.py --collect`
// exports; the kernel is FlashMLA's, only this glue is ours.
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

namespace {

int as_int(int64_t value, const char* what) {
  TORCH_CHECK(value <= std::numeric_limits<int>::max(), what, " does not fit in int32: ", value);
  return static_cast<int>(value);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_prefill(const at::Tensor& q, const at::Tensor& kv,
                                                              const at::Tensor& indices, double sm_scale,
                                                              int64_t d_v) {
  TORCH_CHECK(q.is_cuda() && kv.is_cuda() && indices.is_cuda(), "q, kv and indices must be CUDA tensors");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 3 && indices.dim() == 3,
              "expected q [s_q, h_q, d_qk], kv [s_kv, h_kv, d_qk], indices [s_q, h_kv, topk]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16, "q and kv must be bf16");
  TORCH_CHECK(indices.scalar_type() == at::kInt, "indices must be int32");
  TORCH_CHECK(q.stride(2) == 1 && kv.stride(2) == 1 && indices.stride(2) == 1, "last dims must be contiguous");
  const int64_t s_q = q.size(0), h_q = q.size(1), d_qk = q.size(2);
  const int64_t s_kv = kv.size(0), h_kv = kv.size(1), topk = indices.size(2);
  TORCH_CHECK(kv.size(2) == d_qk && indices.size(0) == s_q && indices.size(1) == h_kv, "shapes disagree");
  // What FlashMLA's SM90 kernel is instantiated for.
  TORCH_CHECK(d_v == 512 && (d_qk == 576 || d_qk == 512), "FlashMLA's SM90 prefill takes d_qk 576 or 512, d_v 512");
  TORCH_CHECK(h_q == 64 || h_q == 128, "FlashMLA's SM90 prefill takes h_q 64 or 128, got ", h_q);

  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({s_q, h_q, d_v}, q.options());
  at::Tensor lse = at::empty({s_q, h_q}, q.options().dtype(at::kFloat));
  at::Tensor max_logits = at::empty({s_q, h_q}, q.options().dtype(at::kFloat));

  SparseAttnFwdParams params{};
  params.s_q = as_int(s_q, "s_q");
  params.s_kv = as_int(s_kv, "s_kv");
  params.h_q = as_int(h_q, "h_q");
  params.h_kv = as_int(h_kv, "h_kv");
  params.d_qk = as_int(d_qk, "d_qk");
  params.d_v = as_int(d_v, "d_v");
  params.topk = as_int(topk, "topk");
  params.sm_scale = static_cast<float>(sm_scale);
  params.sm_scale_div_log2 = static_cast<float>(sm_scale * M_LOG2E);  // FlashMLA's name: scale in log2 units
  params.q = reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr());
  params.kv = reinterpret_cast<cutlass::bfloat16_t*>(kv.data_ptr());
  params.indices = indices.data_ptr<int>();
  params.attn_sink = nullptr;
  params.topk_length = nullptr;
  params.stride_q_s_q = as_int(q.stride(0), "q stride");
  params.stride_q_h_q = as_int(q.stride(1), "q stride");
  params.stride_kv_s_kv = as_int(kv.stride(0), "kv stride");
  params.stride_kv_h_kv = as_int(kv.stride(1), "kv stride");
  params.stride_indices_s_q = as_int(indices.stride(0), "indices stride");
  params.stride_indices_h_kv = as_int(indices.stride(1), "indices stride");
  params.out = reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr());
  params.max_logits = max_logits.data_ptr<float>();
  params.lse = lse.data_ptr<float>();
  params.num_sm = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  params.stream = at::cuda::getCurrentCUDAStream().stream();
  if (d_qk == 576) {
    sm90::fwd::run_fwd_phase1_kernel<576, false>(params);
  } else {
    sm90::fwd::run_fwd_phase1_kernel<512, false>(params);
  }
  return {out, max_logits, lse};
}

}  // namespace

TORCH_LIBRARY(kreg_flashmla_peer, m) {
  m.def("sparse_prefill(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kreg_flashmla_peer, CUDA, m) { m.impl("sparse_prefill", &sparse_prefill); }
