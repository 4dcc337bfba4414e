//! The one error type of kiln: every user-caused failure becomes a `KilnError`
//! that names the tensor, the axis and what was expected.

use std::fmt;

/// How a `KilnError` maps onto Python's exception hierarchy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad value, shape or schedule (Python `ValueError`).
    Value,
    /// Bad dtype or argument type (Python `TypeError`).
    Type,
    /// A broken compiler invariant; a kiln bug, never the user's fault.
    Internal,
}

/// A user-facing compiler error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KilnError {
    pub kind: ErrorKind,
    pub message: String,
}

impl KilnError {
    /// A value/shape/schedule error.
    pub fn value(message: impl Into<String>) -> Self {
        Self { kind: ErrorKind::Value, message: message.into() }
    }
    /// A dtype/argument-type error.
    pub fn type_error(message: impl Into<String>) -> Self {
        Self { kind: ErrorKind::Type, message: message.into() }
    }
    /// A broken internal invariant.
    pub fn internal(message: impl Into<String>) -> Self {
        Self { kind: ErrorKind::Internal, message: message.into() }
    }
}

impl fmt::Display for KilnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ErrorKind::Internal => write!(f, "internal compiler error (please report): {}", self.message),
            _ => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for KilnError {}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, KilnError>;

/// Return early with a value error built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::error::KilnError::value(format!($($arg)*))) };
}

/// Return early with a type error built from a format string.
#[macro_export]
macro_rules! bail_type {
    ($($arg:tt)*) => { return Err($crate::error::KilnError::type_error(format!($($arg)*))) };
}

/// Return early with an internal error built from a format string.
#[macro_export]
macro_rules! bail_internal {
    ($($arg:tt)*) => { return Err($crate::error::KilnError::internal(format!($($arg)*))) };
}
