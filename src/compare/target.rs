//! Where a path runs: `--backend` picks the default, and `PATH@BACKEND` (e.g.
//! `standard@cpu`, `chunk-reuse:rerotate@cuda`) pins one path, so a GPU run can be held to the
//! CPU reference with the same report as any path pair.

use std::fmt;
use std::path::Path;

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::io::model_source::ModelSource;
use crate::paths::PathSpec;

/// Fails at once where the CUDA driver is missing: that is then the whole answer. Where it
/// is, the GPU starts opening now, beside reading the model (a GPU that cannot open is
/// reported when the model first needs it).
pub fn require_cuda() -> Result<()> {
    let probe = crate::support::timing::span("startup: CUDA driver library probed");
    let missing = crate::cuda::driver_missing();
    drop(probe);
    match missing {
        Some(why) => Err(Error::usage("--backend cuda", why, crate::cuda::CUDA_FIX)),
        None => {
            crate::cuda::open_in_background();
            crate::cuda::staging_ahead();
            Ok(())
        }
    }
}

/// The model and tokenizer of `--model` (the embedded default without it), with a progress
/// line while they load. `Backend::Cuda`: the model only on the GPU, read from the checkpoint
/// as bf16 with no f32 copy on the host (for commands that run nothing on the CPU).
pub fn load_engine(model: Option<&Path>, on: Backend) -> Result<Engine> {
    let _progress = crate::support::progress::Progress::spinner("loading the model");
    load_source(ModelSource::from_arg(model)?, on)
}

/// `load_engine` of a model source already resolved.
pub fn load_source(source: ModelSource, on: Backend) -> Result<Engine> {
    load_onto(source, on, false)
}

/// `load_engine` onto the GPU, the weights still streaming in when it returns
/// (`crate::cuda::load_on_cuda_streaming`): `crate::cuda::weights_loaded` must be called
/// before any result is trusted.
pub fn load_engine_streaming(model: Option<&Path>) -> Result<Engine> {
    let _progress = crate::support::progress::Progress::spinner("loading the model");
    load_source_streaming(ModelSource::from_arg(model)?)
}

/// `load_engine_streaming` of a model source already resolved.
pub fn load_source_streaming(source: ModelSource) -> Result<Engine> {
    load_onto(source, Backend::Cuda, true)
}

fn load_onto(source: ModelSource, on: Backend, streaming: bool) -> Result<Engine> {
    match on {
        Backend::Cpu => Engine::load(source),
        Backend::Cuda => Engine::load_with(source, |src| {
            let config = crate::engine::config::Config::load(src)?;
            match streaming {
                true => crate::cuda::load_on_cuda_streaming(src, &config),
                false => crate::cuda::load_on_cuda(src, &config),
            }
        }),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// The f32 reference engine.
    Cpu,
    /// bf16 weights on an NVIDIA GPU, f32 activations and accumulation.
    Cuda,
}

impl Backend {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda),
            other => Err(format!("unknown backend {other:?} (cpu, cuda)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

/// Whether the reference or any target runs on `backend` (`default`: where targets without
/// `@BACKEND` run).
pub fn any_on(reference: &Target, targets: &[Target], default: Backend, backend: Backend) -> bool {
    std::iter::once(reference)
        .chain(targets)
        .any(|t| t.on(default) == backend)
}

/// A path and the backend it runs on (`None`: the run's `--backend`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Target {
    pub path: PathSpec,
    pub backend: Option<Backend>,
}

impl Target {
    /// Parses `PATH` or `PATH@BACKEND`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s.rsplit_once('@') {
            Some((path, backend)) => Ok(Target {
                path: PathSpec::parse(path)?,
                backend: Some(Backend::parse(backend)?),
            }),
            None => Ok(Target {
                path: PathSpec::parse(s)?,
                backend: None,
            }),
        }
    }

    /// The backend, `default` unless pinned.
    pub fn on(&self, default: Backend) -> Backend {
        self.backend.unwrap_or(default)
    }

    /// The name in reports: the bare path when every target of the run is on the CPU, else
    /// `path@backend`.
    pub fn label(&self, default: Backend, show_backend: bool) -> String {
        if show_backend {
            format!("{}@{}", self.path, self.on(default).name())
        } else {
            self.path.to_string()
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.backend {
            Some(b) => write!(f, "{}@{}", self.path, b.name()),
            None => write!(f, "{}", self.path),
        }
    }
}

/// Parses a comma-separated list of `PATH[@BACKEND]`.
pub fn parse_targets(s: &str) -> Result<Vec<Target>, String> {
    crate::paths::parse_comma_list(s, Target::parse)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_and_without_backend() {
        let t = Target::parse("chunk-reuse:rerotate@cuda").unwrap();
        assert_eq!(t.backend, Some(Backend::Cuda));
        assert_eq!(t.to_string(), "chunk-reuse:rerotate@cuda");
        assert_eq!(Target::parse(&t.to_string()).unwrap(), t);
        let t = Target::parse("chunk-reuse:blend:0.5").unwrap();
        assert_eq!((t.backend, t.on(Backend::Cuda)), (None, Backend::Cuda));
        assert_eq!(t.label(Backend::Cpu, false), "chunk-reuse:blend:0.5");
        assert_eq!(t.label(Backend::Cpu, true), "chunk-reuse:blend:0.5@cpu");
        for bad in ["standard@tpu", "@cuda", "standard@", "nope@cpu"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_targets("standard@cpu,cascade").unwrap().len(), 2);
        assert!(parse_targets(",").is_err());
    }
}
