//! Engine errors as Python exceptions. Each `flashattn::Error` variant has
//! a class of the same name in `flashattn.errors`; its fields, read back
//! from the error's `Debug` text (field names and values as the Rust type
//! declares them), become the exception's attributes.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt;

/// A field's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<Value>),
    Bool(bool),
    None,
    /// Anything else (a nested error, a path), as its text.
    Other(String),
}

/// The exception for `e`: `flashattn.errors.from_native(name, message,
/// fields)`, or a `RuntimeError` with the message where that module is
/// missing.
pub fn to_py(py: Python<'_>, e: flashattn::Error) -> PyErr {
    let message = e.to_string();
    let (name, fields) = parse_debug(&format!("{e:?}"));
    let build = || -> PyResult<PyErr> {
        let dict = PyDict::new(py);
        for (k, v) in &fields {
            dict.set_item(k, value_to_py(py, v)?)?;
        }
        let module = py.import("flashattn.errors")?;
        let exc = module.call_method1("from_native", (name.as_str(), message.as_str(), dict))?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|_| PyRuntimeError::new_err(message.clone()))
}

pub fn value_to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Int(i) => i.into_py_any(py)?,
        Value::Float(f) => f.into_py_any(py)?,
        Value::Str(s) | Value::Other(s) => s.into_py_any(py)?,
        Value::Bool(b) => b.into_py_any(py)?,
        Value::None => py.None(),
        Value::List(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(value_to_py(py, item)?)?;
            }
            list.into_any().unbind()
        }
    })
}

/// `Name { a: 1, b: "x" }` → `("Name", [("a", 1), ("b", "x")])`; a unit
/// variant has no fields. Unreadable text ends the fields read so far.
pub fn parse_debug(text: &str) -> (String, Vec<(String, Value)>) {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
    };
    let name = p.ident();
    let mut fields = Vec::new();
    p.ws();
    if p.eat(b'{') {
        loop {
            p.ws();
            if p.eat(b'}') || p.done() {
                break;
            }
            let key = p.ident();
            p.ws();
            if key.is_empty() || !p.eat(b':') {
                break;
            }
            p.ws();
            let Some(value) = p.value() else { break };
            fields.push((key, value));
            p.ws();
            p.eat(b',');
        }
    }
    (name, fields)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.i += hit as usize;
        hit
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn ident(&mut self) -> String {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        {
            self.i += 1;
        }
        String::from_utf8_lossy(&self.s[start..self.i]).into_owned()
    }

    fn value(&mut self) -> Option<Value> {
        match self.peek()? {
            b'"' => self.string().map(Value::Str),
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.ws();
                    if self.eat(b']') {
                        return Some(Value::List(items));
                    }
                    items.push(self.value()?);
                    self.ws();
                    self.eat(b',');
                }
            }
            c if c == b'-' || c.is_ascii_digit() => {
                let start = self.i;
                self.i += 1;
                while self
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'+'))
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).ok()?;
                Some(match t.parse::<i128>() {
                    Ok(i) => Value::Int(i),
                    Err(_) => Value::Float(t.parse().ok()?),
                })
            }
            _ => {
                let start = self.i;
                let word = self.ident();
                match word.as_str() {
                    "None" => return Some(Value::None),
                    "true" => return Some(Value::Bool(true)),
                    "false" => return Some(Value::Bool(false)),
                    "inf" => return Some(Value::Float(f64::INFINITY)),
                    "NaN" => return Some(Value::Float(f64::NAN)),
                    "" => return None,
                    _ => {}
                }
                if word == "Some" && self.eat(b'(') {
                    let inner = self.value()?;
                    self.ws();
                    return self.eat(b')').then_some(inner);
                }
                self.ws();
                // A nested struct or tuple: keep its text.
                if let Some(open @ (b'{' | b'(')) = self.peek() {
                    let close = if open == b'{' { b'}' } else { b')' };
                    let mut depth = 0usize;
                    let mut in_str = false;
                    while let Some(c) = self.peek() {
                        self.i += 1;
                        match c {
                            b'\\' if in_str => self.i += 1,
                            b'"' => in_str = !in_str,
                            c if c == open && !in_str => depth += 1,
                            c if c == close && !in_str => {
                                depth -= 1;
                                if depth == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                }
                let text = String::from_utf8_lossy(&self.s[start..self.i]);
                Some(Value::Other(text.trim().to_string()))
            }
        }
    }

    fn string(&mut self) -> Option<String> {
        self.i += 1;
        let mut out = String::new();
        let mut chars = std::str::from_utf8(&self.s[self.i..]).ok()?.char_indices();
        while let Some((at, c)) = chars.next() {
            match c {
                '"' => {
                    self.i += at + 1;
                    return Some(out);
                }
                '\\' => match chars.next()?.1 {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    'u' => {
                        // \u{XXXX}
                        let mut hex = String::new();
                        for (_, h) in chars.by_ref() {
                            match h {
                                '{' => {}
                                '}' => break,
                                h => hex.push(h),
                            }
                        }
                        out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                    }
                    other => out.push(other),
                },
                c => out.push(c),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind of field the library's errors carry reads back as the
    /// value the variant was built with.
    #[test]
    fn debug_text_reads_back_as_fields() {
        let e = flashattn::Error::HeadDimTooLarge {
            tensor: "q",
            head_dim: 600,
            max: 512,
        };
        let (name, fields) = parse_debug(&format!("{e:?}"));
        assert_eq!(name, "HeadDimTooLarge");
        assert_eq!(
            fields,
            vec![
                ("tensor".into(), Value::Str("q".into())),
                ("head_dim".into(), Value::Int(600)),
                ("max".into(), Value::Int(512)),
            ]
        );
        let e = flashattn::Error::SizeOverflow {
            what: "a \"quoted\" name",
            op: "product",
            operands: vec![1 << 40, 3],
            max: u64::MAX,
        };
        let (name, fields) = parse_debug(&format!("{e:?}"));
        assert_eq!(name, "SizeOverflow");
        assert_eq!(fields[0].1, Value::Str("a \"quoted\" name".into()));
        assert_eq!(
            fields[2].1,
            Value::List(vec![Value::Int(1 << 40), Value::Int(3)])
        );
        assert_eq!(fields[3].1, Value::Int(u64::MAX as i128));
        let (name, fields) = parse_debug(&format!("{:?}", flashattn::Error::DeviceLost));
        assert_eq!((name.as_str(), fields.len()), ("DeviceLost", 0));
        let (_, fields) =
            parse_debug("X { a: Some(1.5), b: None, c: Os { code: 2, kind: NotFound }, d: -inf }");
        assert_eq!(fields[0].1, Value::Float(1.5));
        assert_eq!(fields[1].1, Value::None);
        assert_eq!(
            fields[2].1,
            Value::Other("Os { code: 2, kind: NotFound }".into())
        );
        assert_eq!(fields[3].1, Value::Float(f64::NEG_INFINITY));
    }
}
