//! PLACEHOLDER: filled in by the wire work (decoder of every engine encoding).
use crate::event::{EventBatch, LoadStat};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error("placeholder")]
    Placeholder,
}

pub fn decode_batch(_payload: &[u8]) -> Result<EventBatch, DecodeError> {
    todo!("wire decoder")
}

pub fn decode_load_stat(_payload: &[u8]) -> Result<LoadStat, DecodeError> {
    todo!("wire decoder")
}
