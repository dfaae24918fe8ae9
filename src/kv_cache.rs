//! The keys and values a forward pass attends to. A path owns its cache and decides how it is
//! built; the model only appends to it and reads it.

/// One layer's cache: `keys`/`values` are `[entry, kv_head, head_dim]`, after RoPE for keys.
#[derive(Clone, Debug, Default)]
pub struct LayerKv {
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// Every layer's cache plus, per entry, the global position of the token it stands for.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub layers: Vec<LayerKv>,
    pub positions: Vec<usize>,
    kv_dim: usize,
}

impl KvCache {
    pub fn new(layers: usize, kv_dim: usize) -> Self {
        KvCache {
            layers: vec![LayerKv::default(); layers],
            positions: Vec::new(),
            kv_dim,
        }
    }

    /// Number of entries (tokens) in the cache.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }
}

impl KvCache {
    /// Appends another cache's entries after this one's.
    pub fn append(&mut self, other: KvCache) {
        for (a, b) in self.layers.iter_mut().zip(other.layers) {
            a.keys.extend(b.keys);
            a.values.extend(b.values);
        }
        self.positions.extend(other.positions);
    }
}
