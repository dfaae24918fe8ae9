//! Where a model's files come from: a Hugging Face directory on disk, or the default model
//! compiled into the binary. Everything downstream reads files through this, so the embedded
//! model takes exactly the code path a user's directory takes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};

/// Bytes of one file: memory-mapped from disk, borrowed from the binary, or held in memory.
pub enum Bytes {
    Mapped(Mmap),
    Static(&'static [u8]),
    Shared(Arc<[u8]>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(s) => s,
            Bytes::Shared(s) => s,
        }
    }
}

#[derive(Clone, Debug)]
pub enum ModelSource {
    Dir(PathBuf),
    Embedded,
    /// Files held in memory, by name: for building models in tests and fuzzing the loaders.
    Memory(Arc<BTreeMap<String, Arc<[u8]>>>),
}

/// The embedded default model's files, by name.
const EMBEDDED: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../fixtures/default-model/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../fixtures/default-model/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../fixtures/default-model/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../fixtures/default-model/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../fixtures/default-model/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../../fixtures/default-model/chat_template.jinja"),
    ),
];

impl ModelSource {
    pub fn from_arg(dir: Option<&Path>) -> Result<Self> {
        match dir {
            None => Ok(ModelSource::Embedded),
            Some(d) if d.is_dir() => Ok(ModelSource::Dir(d.to_path_buf())),
            Some(d) if d.exists() => Err(Error::input(
                d,
                "is not a directory",
                "pass --model the Hugging Face model directory (holding config.json, *.safetensors, tokenizer.json)",
            )),
            Some(d) => Err(Error::input(
                d,
                "model directory not found",
                "check the path given to --model, or leave --model out to use the embedded default model",
            )),
        }
    }

    /// The path to name in messages about `name`.
    pub fn path_of(&self, name: &str) -> PathBuf {
        match self {
            ModelSource::Dir(d) => d.join(name),
            ModelSource::Embedded => PathBuf::from(format!("<embedded default model>/{name}")),
            ModelSource::Memory(_) => PathBuf::from(format!("<memory>/{name}")),
        }
    }

    /// A source over in-memory files.
    pub fn memory<'a>(files: impl IntoIterator<Item = (&'a str, Vec<u8>)>) -> Self {
        ModelSource::Memory(Arc::new(
            files
                .into_iter()
                .map(|(n, b)| (n.to_string(), Arc::from(b)))
                .collect(),
        ))
    }

    pub fn describe(&self) -> String {
        match self {
            ModelSource::Dir(d) => d.display().to_string(),
            ModelSource::Embedded => "embedded default model".to_string(),
            ModelSource::Memory(_) => "in-memory model".to_string(),
        }
    }

    pub fn exists(&self, name: &str) -> bool {
        match self {
            ModelSource::Dir(d) => d.join(name).is_file(),
            ModelSource::Embedded => EMBEDDED.iter().any(|(n, _)| *n == name),
            ModelSource::Memory(files) => files.contains_key(name),
        }
    }

    /// Maps a (possibly large) file; `fix` says what to do if it is missing.
    pub fn bytes(&self, name: &str, fix: &str) -> Result<Bytes> {
        match self {
            ModelSource::Dir(d) => {
                let path = d.join(name);
                let file =
                    File::open(&path).map_err(|e| Error::input(&path, open_error(&e), fix))?;
                // Safety: the mapping is read-only; a file truncated under us while mapped is
                // outside what kvdiff can defend against, as for any mmap-based loader.
                let map = unsafe { Mmap::map(&file) }
                    .map_err(|e| Error::input(&path, format!("cannot map: {e}"), fix))?;
                Ok(Bytes::Mapped(map))
            }
            ModelSource::Embedded => EMBEDDED
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, b)| Bytes::Static(b))
                .ok_or_else(|| Error::Internal(format!("embedded model lacks {name}"))),
            ModelSource::Memory(files) => files
                .get(name)
                .map(|b| Bytes::Shared(b.clone()))
                .ok_or_else(|| Error::input(self.path_of(name), "file not found", fix)),
        }
    }

    /// Reads a small text file (JSON, template).
    pub fn text(&self, name: &str, fix: &str) -> Result<Cow<'static, str>> {
        let path = self.path_of(name);
        match self {
            ModelSource::Dir(_) => {
                let bytes =
                    std::fs::read(&path).map_err(|e| Error::input(&path, open_error(&e), fix))?;
                String::from_utf8(bytes)
                    .map(Cow::Owned)
                    .map_err(|_| Error::input(&path, "is not valid UTF-8", fix))
            }
            ModelSource::Memory(_) => {
                let bytes = self.bytes(name, fix)?;
                std::str::from_utf8(&bytes)
                    .map(|s| Cow::Owned(s.to_string()))
                    .map_err(|_| Error::input(&path, "is not valid UTF-8", fix))
            }
            ModelSource::Embedded => {
                let bytes = match self.bytes(name, fix)? {
                    Bytes::Static(b) => b,
                    Bytes::Mapped(_) | Bytes::Shared(_) => {
                        unreachable!("embedded files are static")
                    }
                };
                std::str::from_utf8(bytes)
                    .map(Cow::Borrowed)
                    .map_err(|_| Error::Internal(format!("embedded {name} is not UTF-8")))
            }
        }
    }
}

pub fn open_error(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "file not found".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => format!("cannot read: {e}"),
    }
}
