//! A sparse (MoE) layer's MLP: the router's choice is made on the host, as the CPU model makes
//! it (with the near-tie hints a comparing sink offers), so that both sides route alike; each
//! chosen expert then runs on the rows routed to it. The host in the loop is why a model with
//! sparse layers is never captured into a graph.

use cudarc::driver::CudaSlice;

use super::Pass;
use crate::cuda::gpu::{ptr, Arg};
use crate::cuda::model::{CudaModel, SparseMlp};
use crate::cuda::workspace::Workspace;

impl CudaModel {
    /// A sparse layer's second half: o_proj and residual, the post-attention norm, the router
    /// GEMM, the top-k choice on the host (the logits are copied back, so a pass with sparse
    /// layers waits for the GPU at each of them and is never captured into a graph), then per
    /// chosen expert a gather, its SwiGLU and a weighted scatter-add, and the residual with the
    /// next norm.
    pub(super) fn sparse_mlp(&self, l: usize, ws: &Workspace, sparse: &SparseMlp, pass: &Pass<'_>) {
        let g = &*self.gpu;
        let c = &self.config;
        let moe = c.arch.sparse(l).expect("a sparse layer");
        let (n, io) = (ws.n, ws.io(g, l));
        let (h, e, mi) = (c.hidden_size, moe.num_experts, moe.intermediate_size);
        let pb = |s: &CudaSlice<u16>| ptr(g, s, 0);
        self.attention_output(l, ws);
        let logits_d = g.alloc::<f32>(n * e);
        g.gemm_bf16(
            ws.xn_bf(g),
            pb(&sparse.router),
            ptr(g, &logits_d, 0),
            n,
            h,
            e,
        );
        let logits = g.download(&logits_d, n * e);
        let hint = |p: &usize| pass.hints.as_ref().and_then(|h| h.get(&(l, *p)));
        let routes: Vec<Vec<(usize, f32)>> = logits
            .chunks_exact(e)
            .zip(pass.taps.pos)
            .map(|(row, p)| moe.route_hinted(row, hint(p)))
            .collect();
        // Token lists grouped by expert, uploaded once.
        let (mut idx, mut weight, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        for expert in 0..e {
            let start = idx.len();
            for (t, r) in routes.iter().enumerate() {
                if let Some(&(_, wt)) = r.iter().find(|p| p.0 == expert) {
                    idx.push(t as i32);
                    weight.push(wt);
                }
            }
            if idx.len() > start {
                spans.push((expert, start, idx.len() - start));
            }
        }
        let (idx_d, weight_d) = (g.upload(&idx), g.upload(&weight));
        let most = spans.iter().map(|s| s.2).max().unwrap_or(0);
        let rows_bf = g.alloc::<u16>(most * h);
        let gu = g.alloc::<f32>(most * 2 * mi);
        let act = g.alloc::<u16>(most * mi);
        let y = g.alloc::<f32>(most * h);
        let grid = |len: usize| len.div_ceil(256) as u32;
        g.launch(
            "zero_f32",
            grid(n * h),
            256,
            0,
            &[Arg::Ptr(io.mlp), Arg::I32((n * h) as i32)],
        );
        for (expert, start, count) in spans {
            let (gate_up, down) = &sparse.experts[expert];
            let at = |s: &CudaSlice<i32>| ptr(g, s, start);
            g.launch(
                "gather_rows_bf16",
                grid(count * h),
                256,
                0,
                &[
                    Arg::Ptr(ws.xn_bf(g)),
                    Arg::Ptr(at(&idx_d)),
                    Arg::Ptr(ptr(g, &rows_bf, 0)),
                    Arg::I32(h as i32),
                    Arg::I32(count as i32),
                ],
            );
            g.gemm_bf16(
                ptr(g, &rows_bf, 0),
                pb(gate_up),
                ptr(g, &gu, 0),
                count,
                h,
                2 * mi,
            );
            g.launch(
                "swiglu",
                grid(count * mi),
                256,
                0,
                &[
                    Arg::Ptr(ptr(g, &gu, 0)),
                    Arg::Ptr(ptr(g, &act, 0)),
                    Arg::I32(mi as i32),
                    Arg::I32(count as i32),
                ],
            );
            g.gemm_bf16(ptr(g, &act, 0), pb(down), ptr(g, &y, 0), count, mi, h);
            g.launch(
                "scatter_add_rows",
                grid(count * h),
                256,
                0,
                &[
                    Arg::Ptr(ptr(g, &y, 0)),
                    Arg::Ptr(at(&idx_d)),
                    Arg::Ptr(ptr(g, &weight_d, start)),
                    Arg::Ptr(io.mlp),
                    Arg::I32(h as i32),
                    Arg::I32(count as i32),
                ],
            );
        }
        let next_norm = self.next_norm(l);
        self.add_norm(
            n,
            io.mid,
            io.mlp,
            io.x_out,
            pb(next_norm),
            io.norm_out,
            ws.xn_bf(g),
        );
        let chosen = crate::tap::expert_ids(&routes);
        ws.moe_taps
            .lock()
            .expect("not poisoned")
            .push((l, logits, chosen));
        // The temporaries are freed in stream order, after the launches that read them.
        g.sync();
    }
}
