'use strict';
// A small Node.js client of the kvmesh indexer. The service definitions are
// loaded from proto/ at run time (@grpc/proto-loader), so there is no
// generated code to keep fresh: the .proto files are the contract.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { namespaceSeed, encodeExtras, promptExtras, blockKeys } = require('./blockkeys');
const { STATUS_DETAILS_METADATA, richStatus, fieldViolations, retryDelayMs } = require('./status');

/** The repository's proto/ directory (the import root of every kvmesh proto). */
const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'proto');

/** Trailing metadata key naming the offending field of an INVALID_ARGUMENT. */
const ERROR_FIELD_METADATA = 'kvmesh-error-field';

const LOADER_OPTIONS = {
  keepCase: true, // field names as in the proto: worker_id, block_keys, ...
  longs: String, // 64-bit integers as decimal strings (exact; JS numbers are not)
  enums: String, // enum values by name: TIER_GPU, BATCH_OUTCOME_APPLIED, ...
  defaults: true, // zero values present (depth 0, stale false)
  oneofs: true, // Event.kind names the set member
  includeDirs: [PROTO_ROOT],
};

/** Load one kvmesh proto file, e.g. 'kvmesh/indexer/v1/indexer.proto'. */
function loadProto(file) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, LOADER_OPTIONS));
}

/** Read a PEM file, naming the option in the error. */
function readPem(file, what) {
  let data;
  try {
    data = fs.readFileSync(file);
  } catch (err) {
    throw new Error(`cannot read ${what} ${JSON.stringify(file)}: ${err.message}`);
  }
  if (!data.includes('-----BEGIN')) throw new Error(`${what} ${JSON.stringify(file)} is not PEM`);
  return data;
}

/**
 * A function returning the bearer token: `token` as given, or the content of
 * `tokenFile`, read again whenever the file changes (a rotated Secret).
 */
function tokenSource({ token, tokenFile }) {
  if (token) return () => token;
  let stamp = '';
  let current = '';
  const read = () => {
    const st = fs.statSync(tokenFile);
    const now = `${st.mtimeMs}/${st.ctimeMs}/${st.ino}/${st.size}`;
    if (now !== stamp) {
      const value = fs.readFileSync(tokenFile, 'utf8').trim();
      if (!value) throw new Error(`tokenFile ${JSON.stringify(tokenFile)} is empty`);
      current = value;
      stamp = now;
    }
    return current;
  };
  read(); // fail now, naming the file, rather than on the first call
  return read;
}

/**
 * Channel credentials and options for a kvmesh server.
 *
 * `options.tls`: `true` (system CA roots) or an object with
 *   - `caFile` / `ca`: PEM CA bundle that signs the server's certificate;
 *   - `certFile` + `keyFile` / `cert` + `key`: this client's certificate (mutual TLS);
 *   - `serverName`: name to verify the server certificate against, and send as
 *     SNI, instead of the address's host (`grpc.ssl_target_name_override`);
 *   - `reloadIntervalMs`: re-read `caFile`, `certFile` and `keyFile` this often;
 *     new connections use the files as they are then (grpc-js's experimental
 *     FileWatcherCertificateProvider). Needs `caFile`.
 * `options.token` / `options.tokenFile`: a bearer token sent as
 *   `authorization: Bearer <token>` call credentials (the file is re-read when it
 *   changes). Needs TLS: kvmesh servers ignore a token that arrives in plaintext.
 * `options.loadBalancing`: how calls spread over the addresses the target
 *   resolves to: `'round_robin'` (default: every ready replica in turn) or
 *   `'pick_first'` (one at a time); set as the default service config.
 * `options.channelOptions`: further grpc-js channel options (a
 *   `grpc.service_config` given here wins over `loadBalancing`).
 *
 * Without `tls` and a token the channel is plaintext.
 */
function connection(options = {}) {
  const { tls, token, tokenFile } = options;
  const policy = options.loadBalancing || 'round_robin';
  if (!['round_robin', 'pick_first'].includes(policy)) {
    throw new Error(`loadBalancing: ${JSON.stringify(policy)} is neither round_robin nor pick_first`);
  }
  const channelOptions = {
    'grpc.service_config': JSON.stringify({ loadBalancingConfig: [{ [policy]: {} }] }),
    ...(options.channelOptions || {}),
  };
  if (!tls) {
    if (token || tokenFile) throw new Error('a bearer token needs tls (it is never sent in plaintext)');
    return { credentials: grpc.credentials.createInsecure(), channelOptions };
  }
  const t = tls === true ? {} : tls;
  if (Boolean(t.certFile || t.cert) !== Boolean(t.keyFile || t.key)) {
    throw new Error('tls: a client certificate needs its key, and a key its certificate');
  }
  let credentials;
  if (t.reloadIntervalMs) {
    if (!t.caFile) throw new Error('tls.reloadIntervalMs needs tls.caFile (and files, not PEM values)');
    // Read once here so that a wrong path fails now rather than on every connection.
    readPem(t.caFile, 'tls.caFile');
    if (t.certFile) {
      readPem(t.certFile, 'tls.certFile');
      readPem(t.keyFile, 'tls.keyFile');
    }
    const { FileWatcherCertificateProvider, createCertificateProviderChannelCredentials } = grpc.experimental;
    const caProvider = new FileWatcherCertificateProvider({
      caCertificateFile: t.caFile,
      refreshIntervalMs: t.reloadIntervalMs,
    });
    const identityProvider = t.certFile
      ? new FileWatcherCertificateProvider({
          certificateFile: t.certFile,
          privateKeyFile: t.keyFile,
          refreshIntervalMs: t.reloadIntervalMs,
        })
      : null;
    credentials = createCertificateProviderChannelCredentials(caProvider, identityProvider);
  } else {
    const ca = t.ca || (t.caFile ? readPem(t.caFile, 'tls.caFile') : null);
    const cert = t.cert || (t.certFile ? readPem(t.certFile, 'tls.certFile') : null);
    const key = t.key || (t.keyFile ? readPem(t.keyFile, 'tls.keyFile') : null);
    credentials = grpc.credentials.createSsl(ca, key, cert);
  }
  if (t.serverName) {
    channelOptions['grpc.ssl_target_name_override'] = t.serverName;
    channelOptions['grpc.default_authority'] = t.serverName;
  }
  if (token || tokenFile) {
    const current = tokenSource({ token, tokenFile });
    const bearer = grpc.credentials.createFromMetadataGenerator((_params, callback) => {
      try {
        const md = new grpc.Metadata();
        md.set('authorization', `Bearer ${current()}`);
        callback(null, md);
      } catch (err) {
        callback(err);
      }
    });
    credentials = grpc.credentials.combineChannelCredentials(credentials, bearer);
  }
  return { credentials, channelOptions };
}

/**
 * Client options from the environment (for scripts and the tests):
 * KVMESH_CLIENT_CA_FILE, KVMESH_CLIENT_CERT_FILE, KVMESH_CLIENT_KEY_FILE,
 * KVMESH_CLIENT_SERVER_NAME, KVMESH_CLIENT_TOKEN_FILE. None set: plaintext.
 */
function optionsFromEnv(env = process.env) {
  const tls = {};
  if (env.KVMESH_CLIENT_CA_FILE) tls.caFile = env.KVMESH_CLIENT_CA_FILE;
  if (env.KVMESH_CLIENT_CERT_FILE) tls.certFile = env.KVMESH_CLIENT_CERT_FILE;
  if (env.KVMESH_CLIENT_KEY_FILE) tls.keyFile = env.KVMESH_CLIENT_KEY_FILE;
  if (env.KVMESH_CLIENT_SERVER_NAME) tls.serverName = env.KVMESH_CLIENT_SERVER_NAME;
  const options = {};
  if (Object.keys(tls).length) options.tls = tls;
  if (env.KVMESH_CLIENT_TOKEN_FILE) {
    options.tokenFile = env.KVMESH_CLIENT_TOKEN_FILE;
    options.tls = options.tls || true;
  }
  return options;
}

/**
 * An IndexerService client for `address`: host:port, `dns:///name:port`, or several
 * replica addresses (see `channelTarget`); `options` as for `connection`.
 */
function indexerClient(address, options = {}) {
  const pkg = loadProto('kvmesh/indexer/v1/indexer.proto');
  const { credentials, channelOptions } = connection(options);
  return new pkg.kvmesh.indexer.v1.IndexerService(channelTarget(address), credentials, channelOptions);
}

/** URI schemes of gRPC's resolvers: a target starting with one is used as given. */
const TARGET_SCHEMES = ['dns:', 'ipv4:', 'ipv6:', 'unix:', 'unix-abstract:', 'vsock:', 'xds:'];

/**
 * The gRPC target of `address`: a `host:port` or a resolver URI
 * (`dns:///indexer-headless.ns.svc:50051`: every address the name resolves to)
 * as given; several replica addresses (an array, or one string joined by
 * commas) as one `ipv4:` or `ipv6:` target listing them all. Those must be IP
 * literals of one family (`[addr]:port` for IPv6): a name needs `dns:///`.
 */
function channelTarget(address) {
  const parts = (Array.isArray(address) ? address : String(address).split(','))
    .map((a) => String(a).trim())
    .filter(Boolean);
  if (!parts.length) throw new Error('no indexer address given');
  if (!Array.isArray(address) && TARGET_SCHEMES.some((p) => String(address).trim().startsWith(p))) {
    return String(address).trim();
  }
  if (parts.length === 1) return parts[0];
  const families = parts.map((a) => {
    const m = /^(\[([0-9a-fA-F:.]+)\]|(\d{1,3}(?:\.\d{1,3}){3})):(\d{1,5})$/.exec(a);
    if (!m) {
      throw new Error(`${JSON.stringify(a)}: a list of replicas takes IP addresses (ip:port, [ipv6]:port); for a name use dns:///name:port`);
    }
    return m[2] ? 'ipv6' : 'ipv4';
  });
  if (new Set(families).size > 1) throw new Error(`${parts.join(', ')}: mixes IPv4 and IPv6 addresses`);
  return `${families[0]}:${parts.join(',')}`;
}

/** Call a unary method as a Promise; `deadlineMs` bounds it. */
function unary(client, method, request, deadlineMs = 5000) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + deadlineMs }, (err, res) => (err ? reject(err) : resolve(res)));
  });
}

/**
 * Publish batches over PublishEventsStream, in order, and resolve with one
 * ack per batch (a rejected batch is reported in its ack; the stream goes on).
 */
function publishStream(client, batches, deadlineMs = 10000) {
  return new Promise((resolve, reject) => {
    const acks = [];
    const call = client.PublishEventsStream({ deadline: Date.now() + deadlineMs });
    call.on('data', (res) => acks.push(res.ack));
    call.on('error', reject);
    call.on('end', () => resolve(acks));
    for (const batch of batches) call.write({ batch });
    call.end();
  });
}

/** The field an error names (trailing metadata), or '' when it names none. */
function errorField(err) {
  const values = err && err.metadata ? err.metadata.get(ERROR_FIELD_METADATA) : [];
  return values.length ? String(values[0]) : '';
}

/** Unsigned 64-bit keys (BigInt) as the decimal strings the loader sends exactly. */
function keysToWire(keys) {
  return keys.map((k) => BigInt.asUintN(64, BigInt(k)).toString());
}

module.exports = {
  PROTO_ROOT,
  ERROR_FIELD_METADATA,
  grpc,
  loadProto,
  connection,
  optionsFromEnv,
  indexerClient,
  channelTarget,
  unary,
  publishStream,
  errorField,
  STATUS_DETAILS_METADATA,
  richStatus,
  fieldViolations,
  retryDelayMs,
  keysToWire,
  namespaceSeed,
  encodeExtras,
  promptExtras,
  blockKeys,
};
