//! The `.npy` header, read strictly before any data is: the magic string,
//! the format version (1.0, 2.0, 3.0), the header length (which must lie
//! within the file, so a few hostile bytes cannot make the reader allocate
//! more than the file holds), and the Python dict literal numpy writes,
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`: exactly
//! those three keys, the shape a tuple of non-negative integers that fit
//! `u64`. The parser is a loop over the bytes, not a recursive descent, so
//! no nesting depth can exhaust the stack.

use std::io::Read;
use thiserror::Error;

/// Why a file is not a valid `.npy` file.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HeaderError {
    #[error("it does not start with the .npy magic string \\x93NUMPY")]
    Magic,
    #[error("format version {major}.{minor} (expected 1.0, 2.0 or 3.0)")]
    Version { major: u8, minor: u8 },
    /// The header runs past the end of the file.
    #[error("its header needs {needed} bytes, the file holds {len}")]
    Truncated { needed: u64, len: u64 },
    #[error("its header text is not UTF-8")]
    Text,
    #[error("its header text has {found} at byte {at}, expected {expected}")]
    Syntax {
        at: usize,
        expected: &'static str,
        found: String,
    },
    #[error(
        "its header has a key {key} (expected 'descr', 'fortran_order' and 'shape', once each)"
    )]
    Key { key: String },
    #[error("its header has no '{key}'")]
    Missing { key: &'static str },
    #[error("its shape has a dim {text}, not an integer from 0 to 2^64 - 1")]
    Dim { text: String },
    #[error("reading its header: {0}")]
    Io(String),
}

/// A parsed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The dtype as written (`<f4`; a structured dtype's list as its text).
    pub descr: String,
    pub fortran_order: bool,
    pub shape: Vec<u64>,
    /// Bytes before the data: magic, version, length field and header text.
    pub data_offset: u64,
}

/// Read the header from the start of `r`, a file of `len` bytes.
pub fn read(r: &mut impl Read, len: u64) -> Result<Header, HeaderError> {
    let io = |e: std::io::Error| HeaderError::Io(e.to_string());
    let mut prefix = [0u8; 8];
    read_exact(r, &mut prefix, (8, len))?;
    if &prefix[..6] != b"\x93NUMPY" {
        return Err(HeaderError::Magic);
    }
    let length_bytes = match (prefix[6], prefix[7]) {
        (1, 0) => 2,
        (2 | 3, 0) => 4,
        (major, minor) => return Err(HeaderError::Version { major, minor }),
    };
    let mut field = [0u8; 4];
    read_exact(
        r,
        &mut field[..length_bytes],
        (8 + length_bytes as u64, len),
    )?;
    let text_len = u32::from_le_bytes(field) as u64;
    let data_offset = 8 + length_bytes as u64 + text_len;
    if data_offset > len {
        return Err(HeaderError::Truncated {
            needed: data_offset,
            len,
        });
    }
    // Bounded by the file's length, checked above.
    let mut text = Vec::with_capacity(text_len as usize);
    r.take(text_len).read_to_end(&mut text).map_err(io)?;
    let text = std::str::from_utf8(&text).map_err(|_| HeaderError::Text)?;
    let mut header = parse_dict(text)?;
    header.data_offset = data_offset;
    Ok(header)
}

/// `buf.len()` bytes, or `Truncated` when the file (of `len` bytes) ends
/// before `needed` bytes from its start.
fn read_exact(
    r: &mut impl Read,
    buf: &mut [u8],
    (needed, len): (u64, u64),
) -> Result<(), HeaderError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => HeaderError::Truncated { needed, len },
        _ => HeaderError::Io(e.to_string()),
    })
}

/// The dict literal (with numpy's padding and final newline).
pub fn parse_dict(text: &str) -> Result<Header, HeaderError> {
    let mut p = Cursor { text, at: 0 };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    p.expect('{', "'{'")?;
    loop {
        p.skip_ws();
        if p.eat('}') {
            break;
        }
        let key = p.string()?;
        p.skip_ws();
        p.expect(':', "':'")?;
        p.skip_ws();
        let fresh = match key {
            "descr" => descr.replace(p.descr()?).is_none(),
            "fortran_order" => fortran.replace(p.boolean()?).is_none(),
            "shape" => shape.replace(p.shape()?).is_none(),
            _ => false,
        };
        if !fresh {
            return Err(HeaderError::Key {
                key: format!("'{key}'"),
            });
        }
        p.skip_ws();
        if !p.eat(',') {
            p.expect('}', "',' or '}'")?;
            break;
        }
    }
    p.skip_ws();
    if p.at < text.len() {
        return Err(p.syntax("the end of the header"));
    }
    Ok(Header {
        descr: descr.ok_or(HeaderError::Missing { key: "descr" })?,
        fortran_order: fortran.ok_or(HeaderError::Missing {
            key: "fortran_order",
        })?,
        shape: shape.ok_or(HeaderError::Missing { key: "shape" })?,
        data_offset: 0,
    })
}

/// A position in the header text.
struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<char> {
        self.text[self.at..].chars().next()
    }

    fn skip_ws(&mut self) {
        while let Some(c) = self
            .peek()
            .filter(|c| matches!(c, ' ' | '\t' | '\r' | '\n'))
        {
            self.at += c.len_utf8();
        }
    }

    fn eat(&mut self, c: char) -> bool {
        let hit = self.peek() == Some(c);
        if hit {
            self.at += c.len_utf8();
        }
        hit
    }

    fn expect(&mut self, c: char, expected: &'static str) -> Result<(), HeaderError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.syntax(expected))
        }
    }

    fn syntax(&self, expected: &'static str) -> HeaderError {
        HeaderError::Syntax {
            at: self.at,
            expected,
            found: match self.peek() {
                Some(c) => format!("{c:?}"),
                None => "the end".into(),
            },
        }
    }

    /// A quoted string without escapes (`'<f4'`, `"shape"`).
    fn string(&mut self) -> Result<&'a str, HeaderError> {
        let quote = match self.peek() {
            Some(q @ ('\'' | '"')) => q,
            _ => return Err(self.syntax("a quoted string")),
        };
        let start = self.at + 1;
        match self.text[start..].find([quote, '\\', '\n']) {
            Some(n) if self.text[start + n..].starts_with(quote) => {
                self.at = start + n + 1;
                Ok(&self.text[start..start + n])
            }
            Some(n) => {
                self.at = start + n;
                Err(self.syntax("the string's closing quote (no escapes)"))
            }
            None => {
                self.at = self.text.len();
                Err(self.syntax("the string's closing quote"))
            }
        }
    }

    /// A dtype: a string, or a structured dtype's list kept as its text
    /// (brackets balanced, strings skipped) for the dtype error to show.
    fn descr(&mut self) -> Result<String, HeaderError> {
        if !matches!(self.peek(), Some('[' | '(')) {
            return self.string().map(str::to_owned);
        }
        let start = self.at;
        let mut depth = 0usize;
        while let Some(c) = self.peek() {
            match c {
                '\'' | '"' => {
                    self.string()?;
                    continue;
                }
                '[' | '(' => depth += 1,
                ']' | ')' => depth -= 1,
                _ => {}
            }
            self.at += c.len_utf8();
            if depth == 0 {
                return Ok(self.text[start..self.at].to_owned());
            }
        }
        Err(self.syntax("the dtype list's closing bracket"))
    }

    fn boolean(&mut self) -> Result<bool, HeaderError> {
        for (word, value) in [("True", true), ("False", false)] {
            if self.text[self.at..].starts_with(word) {
                self.at += word.len();
                return Ok(value);
            }
        }
        Err(self.syntax("True or False"))
    }

    /// A tuple of dims: `()`, `(3,)`, `(2, 3)`, `(2, 3,)`.
    fn shape(&mut self) -> Result<Vec<u64>, HeaderError> {
        self.expect('(', "the shape's '('")?;
        let mut dims = Vec::new();
        loop {
            self.skip_ws();
            if self.eat(')') {
                // Python's (3) is the integer 3, not a tuple: (3,) is.
                if dims.len() == 1 {
                    self.at -= 1;
                    return Err(self.syntax("',' (a one-dim shape is written (n,))"));
                }
                return Ok(dims);
            }
            if !dims.is_empty() {
                self.expect(',', "',' or ')'")?;
                self.skip_ws();
                if self.eat(')') {
                    return Ok(dims);
                }
            }
            dims.push(self.dim()?);
        }
    }

    /// A non-negative integer (with Python 2's `L` suffix, as old numpy wrote).
    fn dim(&mut self) -> Result<u64, HeaderError> {
        let rest = &self.text[self.at..];
        let n = rest
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-' && c != '+')
            .unwrap_or(rest.len());
        let token = &rest[..n];
        if token.is_empty() {
            return Err(self.syntax("a dim"));
        }
        let digits = token.strip_suffix('L').unwrap_or(token);
        let value = digits
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| digits.parse::<u64>().ok())
            .flatten()
            .ok_or_else(|| HeaderError::Dim {
                text: token.to_owned(),
            })?;
        self.at += n;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numpys_headers_parse() {
        let h = parse_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }    \n")
            .unwrap();
        assert_eq!(
            (h.descr.as_str(), h.fortran_order, h.shape),
            ("<f4", false, vec![2, 3])
        );
        let h = parse_dict("{\"shape\":(7,),\"fortran_order\":True,\"descr\":\"|b1\"}").unwrap();
        assert_eq!((h.shape, h.fortran_order), (vec![7], true));
        assert_eq!(
            parse_dict("{'descr': '<i8', 'fortran_order': False, 'shape': (), }")
                .unwrap()
                .shape,
            Vec::<u64>::new()
        );
        // Python 2's long suffix.
        assert_eq!(
            parse_dict("{'descr': '<f4', 'fortran_order': False, 'shape': (3L, 4L), }")
                .unwrap()
                .shape,
            vec![3, 4]
        );
        let h = parse_dict(
            "{'descr': [('a', '<f4'), ('b', '<i4', (2,))], 'fortran_order': False, 'shape': (5,)}",
        )
        .unwrap();
        assert_eq!(h.descr, "[('a', '<f4'), ('b', '<i4', (2,))]");
    }

    #[test]
    fn bad_headers_are_typed_errors() {
        let base =
            |shape: &str| format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        assert!(matches!(
            parse_dict(&base("(3)")),
            Err(HeaderError::Syntax { .. })
        ));
        assert!(matches!(
            parse_dict(&base("(18446744073709551616,)")),
            Err(HeaderError::Dim { ref text }) if text == "18446744073709551616"
        ));
        assert!(matches!(
            parse_dict(&base("(-1, 2)")),
            Err(HeaderError::Dim { ref text }) if text == "-1"
        ));
        assert_eq!(
            parse_dict(&base("(18446744073709551615,)")).unwrap().shape,
            vec![u64::MAX]
        );
        assert!(matches!(
            parse_dict("{'descr': '<f4', 'fortran_order': False}"),
            Err(HeaderError::Missing { key: "shape" })
        ));
        assert!(matches!(
            parse_dict("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}"),
            Err(HeaderError::Key { .. })
        ));
        assert!(matches!(
            parse_dict("{'descr': '<f4', 'fortran_order': 0, 'shape': ()}"),
            Err(HeaderError::Syntax { .. })
        ));
        assert!(matches!(
            parse_dict("{'descr': '<f4', 'fortran_order': False, 'shape': ()} x"),
            Err(HeaderError::Syntax { .. })
        ));
        // Deep nesting is a loop, not recursion.
        let deep = format!("{{'descr': {}", "[".repeat(1 << 20));
        assert!(matches!(parse_dict(&deep), Err(HeaderError::Syntax { .. })));
    }

    #[test]
    fn the_header_length_must_lie_within_the_file() {
        let mut file = b"\x93NUMPY\x02\x00".to_vec();
        file.extend(u32::MAX.to_le_bytes());
        file.extend(b"{}");
        let len = file.len() as u64;
        assert_eq!(
            read(&mut file.as_slice(), len),
            Err(HeaderError::Truncated {
                needed: 12 + u32::MAX as u64,
                len
            })
        );
        assert_eq!(
            read(&mut &b"\x93NUMPY\x04\x00"[..], 8),
            Err(HeaderError::Version { major: 4, minor: 0 })
        );
        assert_eq!(
            read(&mut &b"PK\x03\x04"[..], 4),
            Err(HeaderError::Truncated { needed: 8, len: 4 })
        );
        assert_eq!(
            read(&mut &b"\x93NUMPZ\x01\x00\x00\x00"[..], 10),
            Err(HeaderError::Magic)
        );
    }
}
