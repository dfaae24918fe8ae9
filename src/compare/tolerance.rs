//! Learning `auto` tolerances: per tap kind, the relative noise between two exact
//! computations of the same taps, times a safety multiple, above a floor.

use std::collections::BTreeMap;

use crate::compare::diff::{Tolerance, AUTO_FLOOR, AUTO_MULTIPLE};
use crate::compare::driver::CompareSpec;
use crate::error::Result;
use crate::paths::PathSpec;

impl CompareSpec<'_> {
    /// Learns `auto` thresholds: the noise between the reference and an exact path that splits
    /// the prefill differently, times `AUTO_MULTIPLE`, at least `AUTO_FLOOR`, per tap kind.
    pub fn learn_auto(&self) -> Result<Tolerance> {
        let piece = self.prompt.ids.len().div_ceil(3).max(1);
        let learner = CompareSpec {
            tolerance: &Tolerance::Exact,
            max_new_tokens: self.max_new_tokens.min(2),
            dump: None,
            memory_budget: self.memory_budget,
            path_model: self.model,
            ..*self
        };
        let noise = learner.run(PathSpec::ChunkedPrefill(piece))?.noise;
        Ok(Self::thresholds(noise))
    }

    /// Learns `auto` thresholds for holding a bf16 GPU backend to the f32 CPU reference: the
    /// noise between the reference and a CPU run that rounds weights and matmul inputs to bf16
    /// as the GPU does (same path, same prompt), times `AUTO_MULTIPLE`, per tap kind.
    pub fn learn_auto_bf16(&self) -> Result<Tolerance> {
        let emulated = self.model.bf16_emulation();
        let learner = CompareSpec {
            tolerance: &Tolerance::Exact,
            max_new_tokens: self.max_new_tokens.min(2),
            dump: None,
            memory_budget: self.memory_budget,
            path_model: &emulated,
            ..*self
        };
        let noise = learner.run(self.reference)?.noise;
        Ok(Self::thresholds(noise))
    }

    fn thresholds(noise: BTreeMap<String, f32>) -> Tolerance {
        let rtol = noise
            .into_iter()
            .map(|(k, v)| (k, (v * AUTO_MULTIPLE).max(AUTO_FLOOR)))
            .collect();
        Tolerance::Auto { rtol }
    }
}
